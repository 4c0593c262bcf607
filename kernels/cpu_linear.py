"""Float32 linear layers on the CPU from weights packed once: each row computed as it would be alone.

A decode step, a draft's verification or a jump-forward multiplies a few rows by every weight,
a prompt chunk hundreds. MKL's small-M GEMMs read the weights well at one row but cost 1.8-2.4x
that at 8 (so a draft must be mostly kept to pay), and a row's bits change with the row count (so
drafts and batching could change a greedy token at a near-tie). :func:`pack_weight` copies a
weight ``[N, K]`` once, at load, into K-major panels of 48 weight rows; ``panel_linear`` in
``kernels/csrc/cpu_fused.cpp`` then computes every output as one FMA chain over K in order, with
register tiles of 8 rows: the same arithmetic at any row count and row position, at 0.3-0.8x
MKL's time from 1 to 64 rows and about MKL's from 128 to 1,024 (``benchmarks/cpu_linear.py``).
The packed copy doubles the float32 weights' memory (the originals stay for the modules and LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_fused import cpu_fused_ops, fusable


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
