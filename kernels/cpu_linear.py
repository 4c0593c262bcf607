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

A float32 weight whose every group of 32 input columns lies on a GGUF grid (the default model's
weights are its Q4_1 GGUF dequantized, its embedding Q8_0) is packed as that grid instead
(:func:`q4_grid`, :func:`q8_grid`): 4 or 8 bits a weight and a float16 (d, m) or float32 d per group and
column. The kernel decodes each weight to the same float32 value (``q * d + m`` with one rounding,
``q * d`` exactly) and runs the same FMA chains, so :func:`packed_linear` gives the float32 panels'
bits while a decode step reads a fifth of the bytes. ``TRELLIS_WEIGHT_GRIDS=0`` packs float32
panels only (the output is the same; tests compare both).

The quantized runners' weights take the same panels (:func:`pack_int8`, :func:`pack_int4`): int8
with a float32 scale per weight row, int4 two input columns per byte with Q4_1's bf16 group
scales, each weight dequantized in float32 inside the kernel once per 8-row tile. Their rows
stay float32 (torch's int4/int8 kernels round them to bf16): 0.7x torch's int4 kernel's time
from 8 rows and about its time at one, 0.3-0.6x its int8 kernel's at every row count.
"""

from __future__ import annotations

import os
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

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


@dataclass(frozen=True)
class PackedGrid:
    """A float32 weight ``[out_features, in_features]`` stored as its GGUF grid: ``kind`` "q4"
    (Q4_1: ``panels`` as :class:`PackedInt4`'s bytes, ``scales`` float16 [P, K / 32, 2, 48], d and m)
    or "q8" (Q8_0: int8 ``panels`` [P, K, 48], ``scales`` float32 [P, K / 32, 48], d)."""

    kind: str
    panels: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size() + self.scales.numel() * self.scales.element_size()


def weight_grids_enabled() -> bool:
    """Whether :func:`pack_weight` looks for GGUF grids (``TRELLIS_WEIGHT_GRIDS``, default on)."""
    return os.environ.get("TRELLIS_WEIGHT_GRIDS", "1") != "0"


def pack_weight(weight: torch.Tensor, grids: bool | None = None) -> PackedWeight | PackedGrid | None:
    """``weight`` packed for :func:`packed_linear`: as its Q4_1 or Q8_0 grid where every group lies
    on one (``grids``, default :func:`weight_grids_enabled`), else as float32 panels; None where
    the kernel does not apply (no fused ops built, no AVX-512, not a float32 CPU matrix)."""
    ops = cpu_fused_ops()
    if (ops is None or not ops.panel_kernel_vectorised() or weight.dim() != 2 or weight.stride(-1) != 1
            or not fusable(weight)):
        return None
    weight = weight.detach()
    if weight_grids_enabled() if grids is None else grids:
        packed = _pack_grid(weight)
        if packed is not None:
            return packed
    return PackedWeight(ops.pack_panels(weight), weight.shape[0], weight.shape[1])


def packed_linear(x: torch.Tensor, packed: PackedWeight | PackedGrid, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU ``x [..., K]`` with ``weight`` as ``packed``:
    each output row's bits depend on that row of ``x`` only, and are the same from a grid as from
    the float32 panels."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    ops = cpu_fused_ops()
    if isinstance(packed, PackedGrid):
        multiply = ops.q4_grid_linear if packed.kind == "q4" else ops.q8_grid_linear
        out = multiply(rows, packed.panels, packed.scales, packed.out_features)
        if bias is not None:
            out.add_(bias)
    else:
        out = ops.panel_linear(rows, packed.panels, packed.out_features, bias)
    return out.reshape(*x.shape[:-1], packed.out_features)


GRID_CHUNK = 1 << 20  # weights checked at a time: a weight off its grid is known from its first rows


def _by_rows(weight: torch.Tensor, find) -> tuple | None:
    """``find`` over ``weight``'s rows a chunk at a time (float64 copies stay small), its results
    joined; None as soon as a chunk is off its grid, or when K is not whole groups."""
    if weight.shape[1] % INT4_GROUP:
        return None
    rows = max(1, GRID_CHUNK // weight.shape[1])
    found = []
    for start in range(0, weight.shape[0], rows):
        part = find(weight[start : start + rows])
        if part is None:
            return None
        found.append(part)
    return tuple(torch.cat(piece) for piece in zip(*found))


def q4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` as a Q4_1 grid, (q [N, K] 0-15, d [N, K / 32], m [N, K / 32]) with d and
    m float16 values and ``weight == fl(q * d + m)`` (one rounding, the kernel's FMA) for every
    element, or None where any group is off its grid."""
    return _by_rows(weight, _q4_grid_rows)


def _q4_grid_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    n, k = weight.shape
    groups = weight.reshape(-1, INT4_GROUP)
    low = groups.amin(-1)
    if not torch.equal(low.half().float(), low):
        return None
    span = groups.amax(-1).double() - low.double()
    q = torch.empty_like(groups, dtype=torch.uint8)
    d = torch.empty_like(low)
    pending = torch.arange(len(low))
    # Q4_1 puts a group's minimum at q = 0 and its maximum at 15 (up to the rounding of d): the
    # likeliest d first, the rest only for the groups it did not fit
    for top, step in ((15, 0), (15, 1), (15, -1), (14, 0), (14, 1), (14, -1), (13, 0)):
        near = (span[pending] / top).half()
        if step:
            near = torch.nextafter(near, torch.full_like(near, float("inf") if step > 0 else float("-inf")))
        fits, values = _q4_fits(groups[pending], low[pending], near.float())
        q[pending[fits]] = values[fits].to(torch.uint8)
        d[pending[fits]] = near[fits].float()
        pending = pending[~fits]
        if len(pending) == 0:
            return q.reshape(n, k), d.reshape(n, -1), low.reshape(n, -1)
    return None


def _q4_fits(groups: torch.Tensor, low: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(which groups are exactly ``fl(q * d + low)``, their q), in float32: q (4 bits) times a
    float16 d (11) is exact, so the sum's one rounding is the FMA's."""
    q = torch.round((groups - low[:, None]) / torch.where(d > 0, d, 1.0)[:, None]) * (d > 0)[:, None]
    fits = ((q >= 0) & (q <= 15) & (q * d[:, None] + low[:, None] == groups)).all(-1)
    return fits, q


def q8_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``weight [N, K]`` as a Q8_0 grid, (q [N, K] int8, d [N, K / 32]) with d float16 values and
    ``weight == q * d`` exactly, or None where any group is off its grid."""
    return _by_rows(weight, _q8_grid_rows)


def _q8_grid_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    n, k = weight.shape
    groups = weight.reshape(-1, INT4_GROUP)
    top = groups.abs().amax(-1).double()
    q = torch.empty_like(groups, dtype=torch.int8)
    d = torch.empty_like(top, dtype=torch.float32)
    pending = torch.arange(len(top))
    for largest in (127, 126):  # Q8_0 puts a group's largest magnitude at 127 (up to the rounding of d)
        scale = top[pending] / largest  # float64: checked to be a float16 value, then exact in float32
        exact = scale.half().double() == scale
        scale = scale.float()
        values = torch.round(groups[pending] / torch.where(scale > 0, scale, 1.0)[:, None]) * (scale > 0)[:, None]
        # q (8 bits) times a float16 d (11) is exact in float32
        fits = exact & ((values.abs() <= 127) & (values * scale[:, None] == groups[pending])).all(-1)
        q[pending[fits]] = values[fits].to(torch.int8)
        d[pending[fits]] = scale[fits]
        pending = pending[~fits]
        if len(pending) == 0:
            return q.reshape(n, k), d.reshape(n, -1)
    return None


def _pack_grid(weight: torch.Tensor) -> PackedGrid | None:
    """``weight`` as :class:`PackedGrid` where it lies on a Q4_1 or Q8_0 grid, else None."""
    n, k = weight.shape
    groups = k // INT4_GROUP
    panels = -(-n // PANEL)
    four = q4_grid(weight)
    if four is not None:
        q, d, m = four
        packed, scales = _int4_panels(q, torch.stack([d, m], dim=-1).half())  # d and m are float16 values
        return PackedGrid("q4", packed, scales, n, k)
    eight = q8_grid(weight)
    if eight is not None:
        q, d = eight
        scales = _pad_rows(d, panels * PANEL).reshape(panels, PANEL, groups).permute(0, 2, 1).contiguous()
        return PackedGrid("q8", cpu_fused_ops().pack_panels(q.contiguous()), scales, n, k)
    return None


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
    packed, packed_scales = _int4_panels(values, scales.to(torch.bfloat16).transpose(0, 1).contiguous())
    return PackedInt4(packed, packed_scales, out_features)


def _int4_panels(values: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [N, K]`` (0-15) as the kernels' int4 bytes [P, K / 2, 48], two input columns a byte
    (low nibble first), and each row's per-group ``pairs [N, K / 32, 2]`` as [P, K / 32, 2, 48]."""
    out_features, in_features = values.shape
    panels = -(-out_features // PANEL)
    nibbles = values.to(torch.uint8).reshape(out_features, in_features // 2, 2)
    bytes_ = _pad_rows(nibbles[..., 0] | (nibbles[..., 1] << 4), panels * PANEL)  # [N', K / 2]
    packed = bytes_.reshape(panels, PANEL, in_features // 2).transpose(1, 2).contiguous()
    per_row = _pad_rows(pairs, panels * PANEL)  # [N', G, 2]
    scales = per_row.reshape(panels, PANEL, in_features // INT4_GROUP, 2).permute(0, 2, 3, 1).contiguous()
    return packed, scales


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
