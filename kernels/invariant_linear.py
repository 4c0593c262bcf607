"""Batch-invariant linear layers: a row's output does not depend on the other rows of the call.

With cuBLAS (and :class:`kernels.gemv.GemvChoice`) the kernel, its tiles and its split-K are
chosen by the row count, so in bfloat16 a sequence's logits move by an ulp when the batch
around it changes, when drafts or a jump-forward add rows, or when a CUDA graph pads the step;
greedy ties then flip and "same seed, same tokens" breaks across speed features.
:func:`invariant_linear` runs :mod:`kernels._invariant_gemm_triton`: every output element is one
float32 sum over K in fixed ``BLOCK_K`` chunks, whatever M. The row/column tile follows M for
speed (a decode step's few rows want narrow column tiles to fill the SMs, a prompt chunk wide
ones), which leaves the bits alone only if the device's matrix units sum a chunk the same way at
every tile shape: :func:`agreeing_tiles` checks that once per device and dtype, and a tile that
disagrees is replaced by the base tile. Off CUDA (and without Triton) it is ``F.linear``: the CPU
paths are tested for identity on their own. :func:`kernels.gemv.skinny_linear_reference` is the
oracle.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels._backend import select_backend

Tile = tuple[int, int, int]  # (BLOCK_M, BLOCK_N, num_warps)

BLOCK_K = 128  # the one block that orders the sums: never a function of M
BASE_TILE: Tile = (16, 64, 4)
_MID_TILE: Tile = (64, 64, 4)  # 17-64 rows
_WIDE_TILE: Tile = (128, 128, 8)  # a prompt chunk


@functools.cache
def _triton_module() -> ModuleType | None:
    """``kernels._invariant_gemm_triton``, or None when Triton cannot be imported."""
    try:
        from kernels import _invariant_gemm_triton
    except Exception:  # noqa: BLE001 (ImportError, or a broken backend raising at import)
        return None
    return _invariant_gemm_triton


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_wanted(device: torch.device) -> int:
    """Column tiles a few-row call should have: twice the SM count on CUDA."""
    if device.type != "cuda":
        return 1
    return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def tile_for(rows: int, n: int, device: torch.device) -> Tile:
    """The tile a call of ``rows`` rows against N columns asks for (before :func:`agreeing_tiles`):
    up to 16 rows, columns 64, 32 or 16 wide, the widest that still gives the SMs enough
    programs (a decode projection reads its weight once, so parallelism is its bandwidth)."""
    if rows > 64:
        return _WIDE_TILE
    if rows > 16:
        return _MID_TILE
    wanted = _programs_wanted(device)
    for block_n in (64, 32):
        if -(-n // block_n) >= wanted:
            return (16, block_n, 4)
    return (16, 16, 4)


def _candidate_tiles() -> tuple[Tile, ...]:
    return (BASE_TILE, (16, 32, 4), (16, 16, 4), _MID_TILE, _WIDE_TILE)


@functools.cache
def agreeing_tiles(device_type: str, device_index: int | None, dtype: torch.dtype) -> frozenset[Tile]:
    """The tiles whose bits equal :data:`BASE_TILE`'s on this device and dtype, checked once on a
    random product of several K chunks (the matrix units' summation within a chunk is the
    device's; a tile that sums differently would show on such data at once)."""
    mod = _triton_module()
    if mod is None:
        return frozenset({BASE_TILE})
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5 * BLOCK_K + 40, generator=gen).to(dtype).to(device)
    weight = (torch.randn(160, x.shape[1], generator=gen) / x.shape[1] ** 0.5).to(dtype).to(device)
    base = mod.invariant_gemm(x, weight, None, BASE_TILE, BLOCK_K)
    return frozenset(t for t in _candidate_tiles() if torch.equal(mod.invariant_gemm(x, weight, None, t, BLOCK_K), base))


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``, each
    row computed the same way whatever the number of rows (see the module docstring).

    ``use_triton`` follows :func:`kernels.select_backend` (``True`` with ``TRITON_INTERPRET=1``
    runs the kernel on CPU tensors, for tests); without Triton, ``F.linear``. ``tile`` overrides
    the tile (tests and benchmarks; it never changes the bits where the device agrees)."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    mod = _triton_module() if select_backend(x, use_triton) == "triton" else None
    if mod is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if tile is None:
        tile = tile_for(flat.shape[0], n, x.device)
        if tile not in agreeing_tiles(x.device.type, x.device.index, weight.dtype):
            tile = BASE_TILE
    return mod.invariant_gemm(flat, weight, bias, tile, BLOCK_K).view(*x.shape[:-1], n)
