"""Batch-invariant linear layers: a row's output does not depend on the other rows of the call.

With cuBLAS (and :class:`kernels.gemv.GemvChoice`) the kernel, its tiles and its split-K are
chosen by the row count, so in bfloat16 a sequence's logits move by an ulp when the batch
around it changes, when drafts or a jump-forward add rows, or when a CUDA graph pads the step;
greedy ties then flip and "same seed, same tokens" breaks across speed features.
:func:`invariant_linear` runs :func:`kernels._gemv_triton.gemm_rows`: every output element is one
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
from kernels.gemv import _check_shapes, _sm_count, _triton_module  # the same kernel module and checks

Tile = tuple[int, int, int]  # (BLOCK_M, BLOCK_N, num_warps)

BLOCK_K = 128  # the one block that orders the sums: never a function of M
BASE_TILE: Tile = (16, 64, 4)
_MID_TILE: Tile = (64, 64, 4)
_WIDE_TILE: Tile = (128, 128, 8)  # a prompt chunk


def _sm_count_of(device: torch.device) -> int:
    """The device's SM count on CUDA; 1 elsewhere (the interpreter: any tile fills it)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _programs(tile: Tile, rows: int, n: int) -> int:
    return -(-rows // tile[0]) * -(-n // tile[1])


def tile_for(rows: int, n: int, device: torch.device, element_size: int = 2) -> Tile:
    """The tile a call of ``rows`` rows against N columns asks for (before :func:`agreeing_tiles`).

    A prompt chunk (more than 64 rows) takes the widest tile that still gives every SM a
    program (128 x 128 for 2-byte operands only: 4-byte ones would not fit shared memory).
    Fewer rows, or too few programs, take 16-row tiles with columns 64, 32 or 16 wide: the widest
    that gives the SMs twice their count of programs (a decode projection reads its weight once,
    so the number of programs reading it in parallel is its bandwidth)."""
    sms = _sm_count_of(device)
    if rows > 64:
        wide = (_WIDE_TILE, _MID_TILE) if element_size <= 2 else (_MID_TILE,)
        for tile in wide:
            if _programs(tile, rows, n) >= sms:
                return tile
    for block_n in (64, 32):
        if _programs((16, block_n, 4), rows, n) >= 2 * sms:
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
    base = mod.gemm_rows(x, weight, None, BASE_TILE, BLOCK_K)
    return frozenset({BASE_TILE} | {t for t in _candidate_tiles() if _same_bits(mod, x, weight, t, base)})


def _same_bits(mod: ModuleType, x: torch.Tensor, weight: torch.Tensor, tile: Tile, base: torch.Tensor) -> bool:
    """``tile`` computes ``base``'s bits; False where it cannot run (e.g. shared memory)."""
    try:
        return torch.equal(mod.gemm_rows(x, weight, None, tile, BLOCK_K), base)
    except Exception:  # noqa: BLE001 (Triton's OutOfResources, a compile error: the tile is not used)
        return False


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
    _check_shapes(x, weight, bias)
    mod = _triton_module() if select_backend(x, use_triton) == "triton" else None
    if mod is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if tile is None:
        tile = tile_for(flat.shape[0], n, x.device, weight.element_size())
        if tile not in agreeing_tiles(x.device.type, x.device.index, weight.dtype):
            tile = BASE_TILE
    return mod.gemm_rows(flat, weight, bias, tile, BLOCK_K).view(*x.shape[:-1], n)
