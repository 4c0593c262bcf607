"""Batch-invariant linear layers: a row's output does not depend on the other rows of the call.

With cuBLAS (and :class:`kernels.gemv.GemvChoice`) the kernel, its tiles and its split-K are
chosen by the row count, so in bfloat16 a sequence's logits move by an ulp when the batch
around it changes, when drafts or a jump-forward add rows, or when a CUDA graph pads the step;
greedy ties then flip and "same seed, same tokens" breaks across speed features.
:func:`invariant_linear` runs :mod:`kernels._invariant_gemm_triton` with a configuration taken
from the weight's shape alone (:func:`invariant_config`), so every row is the same sequence of
float operations at any M. Off CUDA (and without Triton) it is ``F.linear``: the CPU paths are
tested for identity on their own. :func:`kernels.gemv.skinny_linear_reference` is the oracle.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels._backend import select_backend

_BLOCK_N = 64
_BLOCK_K = 128
_MAX_SPLIT = 16
_MAX_GRID_ROWS = 32768  # the split reduction puts rows on a grid axis (at most 65,535)


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


def invariant_config(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """``(split_k, block_n, block_k)`` for a weight [N, K] on ``device``, never from the row
    count: on CUDA enough K splits (a power of two, at most 16, at most one per ``block_k``
    chunk) that a one-row call still has about twice the SM count of programs; elsewhere 1."""
    if device.type != "cuda":
        return 1, _BLOCK_N, _BLOCK_K
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = -(-2 * _sm_count(index) // -(-n // _BLOCK_N))
    split = 1
    while split < min(want, _MAX_SPLIT, -(-k // _BLOCK_K)):
        split *= 2
    return split, _BLOCK_N, _BLOCK_K


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``, each
    row computed the same way whatever the number of rows (see the module docstring).

    ``use_triton`` follows :func:`kernels.select_backend` (``True`` with ``TRITON_INTERPRET=1``
    runs the kernel on CPU tensors, for tests); without Triton, ``F.linear``. ``split_k``
    overrides :func:`invariant_config`'s (tests)."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    mod = _triton_module() if select_backend(x, use_triton) == "triton" else None
    if mod is None:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    splits, block_n, block_k = invariant_config(n, k, x.device)
    if split_k is not None:
        splits = split_k
    flat = x.reshape(-1, k)
    parts = [mod.invariant_gemm(flat[i:i + _MAX_GRID_ROWS], weight, bias, splits, block_n, block_k)
             for i in range(0, max(flat.shape[0], 1), _MAX_GRID_ROWS)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.view(*x.shape[:-1], n)
