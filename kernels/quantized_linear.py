"""Weight-only quantized linear layers for the CPU: int4 by groups, int8 per output row, bf16.

A decode step on a CPU reads every weight once per token, so the weights' size is the step:
stored as float32 the default model's linear layers are 540 MB. torch ships CPU kernels that
multiply bf16 activations by 4- or 8-bit weights without expanding them
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``; AVX-512/AMX where the
CPU has them); Trellis quantizes at load and calls them. int8 weights are also packed into
:mod:`kernels.cpu_linear`'s panels, which multiply float32 rows by them (torch's int8 kernel
rounds the activations to bf16 and cost 80 ms for 16 rows of the default model's output layer
here, the panels ~25): float32 rows take the panels. Each kernel computes a row the same
way whatever the number of rows (checked in the tests), so a token's logits do not depend on
what else is in the step.

int4 is asymmetric per group of ``group_size`` input columns (a scale and a zero point per
group and output row), as GGUF's Q4_1: a weight quantized to Q4_1 (a 32-block's minimum and
maximum on the grid's ends) comes back exactly, up to the bf16 rounding of the scales. int8 is
symmetric per output row. bf16 is the weight rounded to bfloat16 and packed once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``), multiplied by ``mkldnn._linear_pointwise``
(AMX where the CPU has it): on this project's CPU 1.5x float32's decode step, and as fast for 16
rows as for one, where float32's small-row GEMMs cost 2.2x at 8 rows; each row is computed as
it would be alone (checked up to 600 rows).

:meth:`QuantizedWeight.dequantized` is the weight the kernel multiplies by, as a float tensor:
the references (``x @ dequantized.T`` in float32) are the test oracles, and the engine runs a
prompt's many rows through it in bf16, where a dense matmul is faster than the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_fused import cpu_fused_ops
from kernels.cpu_linear import PackedInt4, PackedInt8, int4_linear, int8_linear, pack_int4, pack_int8

KINDS = ("int4", "int8", "bf16")
INT4_GROUP = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight [out, in] quantized for one of the CPU kernels.

    ``data``: int4 packed by ``aten._convert_weight_to_int4pack_for_cpu``, int8 [out, in], or
    bf16 in oneDNN's packed layout (an opaque mkldnn tensor).
    ``scales``: int4 [in / group, out, 2] bf16 (scale, zero: ``w = (q - 8) * scale + zero``),
    int8 [out] bf16 (``w = q * scale``), bf16 empty.
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    group_size: int
    shape: tuple[int, int]
    panels: PackedInt8 | PackedInt4 | None = None  # the same weights as kernels.cpu_linear's panels

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the kernel multiplies by (its integers times their scales)."""
        values = _unpack(self)
        if self.kind == "bf16":
            return values.to(dtype)
        if self.kind == "int8":
            return (values.float() * self.scales.float()[:, None]).to(dtype)
        scale = self.scales[..., 0].float().t().repeat_interleave(self.group_size, dim=1)
        zero = self.scales[..., 1].float().t().repeat_interleave(self.group_size, dim=1)
        return ((values.float() - 8) * scale + zero).to(dtype)

    @property
    def nbytes(self) -> int:
        """The bytes a decode step reads: the panels and their scales where float32 rows take
        them (torch's packed copy stays beside them for bf16 rows and :meth:`dequantized`)."""
        if self.kind == "bf16":
            return 2 * self.shape[0] * self.shape[1]  # the packed tensor's own size is opaque
        if self.panels is not None:
            return _size(self.panels.panels) + _size(self.panels.scales)
        return _size(self.data) + _size(self.scales)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def supports(kind: str, weight: torch.Tensor, group_size: int = INT4_GROUP) -> bool:
    """Whether ``weight`` [out, in] can be quantized as ``kind`` (int4 needs whole groups and
    an even output count)."""
    if kind not in KINDS or weight.dim() != 2 or weight.device.type != "cpu":
        return False
    if kind == "bf16":
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    out_features, in_features = weight.shape
    return kind == "int8" or (in_features % group_size == 0 and out_features % 2 == 0)


def quantize(weight: torch.Tensor, kind: str, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """``weight`` [out, in] (any float dtype, CPU) quantized as ``kind`` (see :func:`supports`)."""
    if not supports(kind, weight, group_size):
        raise ValueError(f"cannot quantize a {tuple(weight.shape)} {weight.device.type} weight as {kind}")
    with torch.no_grad():
        if kind == "bf16":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), 1)
            return QuantizedWeight("bf16", packed, torch.empty(0, dtype=torch.bfloat16), 0, tuple(weight.shape))
        return _quantize_int4(weight.float(), group_size) if kind == "int4" else _quantize_int8(weight.float())


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ W^T`` for x [N, in] in bf16 (the kernels' input), through the CPU kernel; bf16 out."""
    if weight.kind == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.data, weight.group_size, weight.scales)
    if weight.kind == "bf16":
        return torch.ops.mkldnn._linear_pointwise(x, weight.data, None, "none", [], "")
    return torch.ops.aten._weight_int8pack_mm(x, weight.data, weight.scales)


def quantized_linear_float32(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """:func:`quantized_linear` of float32 rows, float32 out: int8 through its panels (float32
    activations, :func:`kernels.cpu_linear.int8_linear`), int4 with the bf16 casts in the same C++
    call where :mod:`kernels.cpu_fused` is built (two dispatches fewer per projection)."""
    ops = cpu_fused_ops() if weight.kind in ("int4", "int8") else None
    if ops is None:
        return quantized_linear(x.to(torch.bfloat16), weight).to(torch.float32)
    if isinstance(weight.panels, PackedInt4) and x.dim() == 2:
        return int4_linear(x, weight.panels)
    if isinstance(weight.panels, PackedInt8) and x.dim() == 2:
        return int8_linear(x, weight.panels)
    if weight.kind == "int4":
        return ops.int4_linear(x, weight.data, weight.group_size, weight.scales)
    return ops.int8_linear(x, weight.data, weight.scales)


def quantized_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The oracle: float32 ``x @ dequantized^T``."""
    return x.float() @ weight.dequantized().t()


def _quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    # the scales are stored in bf16: quantize against the rounded ones, so the grid is the kernel's
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    values = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    values = values.reshape(out_features, in_features).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    panels = pack_int4(values, scales) if group_size == INT4_GROUP else None
    return QuantizedWeight("int4", packed, scales, group_size, (out_features, in_features), panels)


def _quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
    values = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", values, scale, 0, tuple(weight.shape), pack_int8(values, scale))


def _unpack(weight: QuantizedWeight) -> torch.Tensor:
    """The integers [out, in]: int8's as stored; int4's read back through the kernel (an
    identity input gives ``(q - 8) * 1 + 8`` per column with unit scales and zero points 8);
    bf16's values read back through the kernel the same way (exact: one product per output)."""
    if weight.kind == "int8":
        return weight.data
    if weight.kind == "bf16":
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        return torch.ops.mkldnn._linear_pointwise(eye, weight.data, None, "none", [], "").t().contiguous()
    out_features, in_features = weight.shape
    unit = torch.empty_like(weight.scales)
    unit[..., 0], unit[..., 1] = 1.0, 8.0
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    columns = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, weight.data, weight.group_size, unit)
    return columns.t().round().to(torch.uint8)
