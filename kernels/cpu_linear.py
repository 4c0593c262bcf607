"""Linear layers on the CPU from weights packed once: each row computed as it would be alone.

A decode step, a draft's verification or a jump-forward multiplies a few rows by every weight,
a prompt chunk hundreds. MKL's small-M GEMMs read the weights well at one row but cost 1.8-2.4x
that at 8 (so a draft must be mostly kept to pay), and a row's bits change with the row count (so
drafts and batching could change a greedy token at a near-tie). :func:`pack_weight` copies a
weight ``[N, K]`` once, at load, into K-major panels of 48 weight rows; ``panel_linear`` in
``kernels/csrc/cpu_fused.cpp`` then computes every output as one FMA chain over K in order, with
register tiles of 8 rows: the same arithmetic at any row count and row position, at 0.3-0.8x
MKL's time from 1 to 64 rows and about MKL's from 128 to 1,024 (``benchmarks/cpu_linear.py``).
The packed copy doubles the float32 weights' memory (the originals stay for the modules and LoRA).

The quantized runners' weights take the same panels (:func:`pack_int8`, :func:`pack_int4`): int8
with a float32 scale per weight row, int4 two input columns per byte with Q4_1's bf16 group
scales, each weight dequantized in float32 inside the kernel once per 8-row tile. Their rows
stay float32 (torch's int4/int8 kernels round them to bf16): 0.7x torch's int4 kernel's time
from 8 rows and about its time at one, 0.3-0.6x its int8 kernel's at every row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_fused import cpu_fused_ops, fusable

PANEL = 48  # weight rows per panel (the kernel's kPanel)
INT4_GROUP = 32  # input columns per int4 scale (the kernel's kInt4Group)


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight ``[out_features, in_features]`` as ``panel_linear``'s panels."""

    panels: torch.Tensor  # [ceil(out_features / 48), in_features, 48]
    out_features: int
    in_features: int


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` packed for :func:`packed_linear`; None where the kernel does not apply (no fused
    ops built, no AVX-512, not a float32 CPU matrix)."""
    ops = cpu_fused_ops()
    if (ops is None or not ops.panel_kernel_vectorised() or weight.dim() != 2 or weight.stride(-1) != 1
            or not fusable(weight)):
        return None
    return PackedWeight(ops.pack_panels(weight.detach()), weight.shape[0], weight.shape[1])


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU ``x [..., K]`` with ``weight`` as ``packed``:
    each output row's bits depend on that row of ``x`` only."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = cpu_fused_ops().panel_linear(rows, packed.panels, packed.out_features, bias)
    return out.reshape(*x.shape[:-1], packed.out_features)


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight ``[out_features, in_features]`` (``w = q * scale`` per output row) as
    ``int8_panel_linear``'s panels, with its scales in float32, padded to the panels."""

    panels: torch.Tensor  # int8 [ceil(out_features / 48), in_features, 48]
    scales: torch.Tensor  # float32 [panels * 48]
    out_features: int


def pack_int8(values: torch.Tensor, scales: torch.Tensor) -> PackedInt8 | None:
    """int8 ``values [N, K]`` and their per-row ``scales [N]`` packed for :func:`int8_linear`;
    None where the kernel does not apply."""
    ops = cpu_fused_ops()
    if ops is None or not ops.panel_kernel_vectorised() or values.dtype != torch.int8 or values.dim() != 2:
        return None
    panels = ops.pack_panels(values.contiguous())
    padded = torch.zeros(panels.shape[0] * panels.shape[2], dtype=torch.float32)
    padded[: values.shape[0]] = scales.float()
    return PackedInt8(panels, padded, values.shape[0])


def int8_linear(x: torch.Tensor, packed: PackedInt8) -> torch.Tensor:
    """float32 ``x [M, K]`` times the int8 weight: each output the FMA chain over ``x`` and the
    integers, times the row's scale (float32 activations, where torch's kernel rounds them to
    bf16); a row's bits depend on that row of ``x`` only."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return cpu_fused_ops().int8_panel_linear(rows, packed.panels, packed.scales, packed.out_features)


@dataclass(frozen=True)
class PackedInt4:
    """An int4 weight (groups of 32 input columns, ``w = (q - 8) * scale + zero``) as
    ``int4_panel_linear``'s panels: two input columns per byte, low nibble first, and each
    group's scale and zero point per weight row (bf16, as quantized)."""

    panels: torch.Tensor  # uint8 [ceil(out_features / 48), in_features / 2, 48]
    scales: torch.Tensor  # bf16 [panels, in_features / 32, 2, 48]: scale, zero point
    out_features: int


def pack_int4(values: torch.Tensor, scales: torch.Tensor) -> PackedInt4 | None:
    """``values [N, K]`` (integers 0-15) and ``scales [K / 32, N, 2]`` (scale, zero point) packed
    for :func:`int4_linear`; None where the kernel does not apply."""
    ops = cpu_fused_ops()
    out_features, in_features = values.shape
    if ops is None or not ops.panel_kernel_vectorised() or in_features % INT4_GROUP:
        return None
    panels = -(-out_features // PANEL)
    nibbles = values.to(torch.uint8).reshape(out_features, in_features // 2, 2)
    pairs = _pad_rows(nibbles[..., 0] | (nibbles[..., 1] << 4), panels * PANEL)  # [N', K / 2]
    packed = pairs.reshape(panels, PANEL, in_features // 2).transpose(1, 2).contiguous()
    per_row = _pad_rows(scales.to(torch.bfloat16).transpose(0, 1).contiguous(), panels * PANEL)  # [N', G, 2]
    groups = in_features // INT4_GROUP
    packed_scales = per_row.reshape(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous()
    return PackedInt4(packed, packed_scales, out_features)


def int4_linear(x: torch.Tensor, packed: PackedInt4) -> torch.Tensor:
    """float32 ``x [M, K]`` times the int4 weight: each weight dequantized in float32, each output
    the FMA chain over ``x`` (float32 activations, where torch's kernel rounds them to bf16); a
    row's bits depend on that row of ``x`` only."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    return cpu_fused_ops().int4_panel_linear(rows, packed.panels, packed.scales, packed.out_features)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
