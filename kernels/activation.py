"""The gated MLP's activation, ``silu(gate) * up``, as one kernel over the output of the
concatenated gate/up projection (``x`` [N, 2 * I]: gate columns first, then up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._backend import layer_kernels, select_backend


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The torch oracle of :func:`silu_mul`: transformers' ``act_fn(gate) * up`` in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x [N, 2 * I] (contiguous last dimension): [N, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, 2 * I] with a contiguous last dimension, got {tuple(x.shape)}")
    if select_backend(x, use_triton) == "triton":
        mod = layer_kernels()
        if mod is not None:
            return mod.silu_mul(x)
    return silu_mul_reference(x)
