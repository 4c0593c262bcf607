"""The gated MLP's activation, ``silu(gate) * up``, as one kernel over the output of the
concatenated gate/up projection (``x`` [N, 2 * I]: gate columns first, then up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._backend import layer_kernels, select_backend
from kernels.cpu_fused import cpu_fused_ops, fusable


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The torch oracle of :func:`silu_mul`: transformers' ``act_fn(gate) * up`` in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor, *, use_triton: bool | None = None, cpu_fused: bool = False) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x [N, 2 * I] (contiguous last dimension): [N, I].
    ``cpu_fused``: a float32 CPU ``x`` goes through :mod:`kernels.cpu_fused` where it is built."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, 2 * I] with a contiguous last dimension, got {tuple(x.shape)}")
    if cpu_fused and fusable(x) and (ops := cpu_fused_ops()) is not None:
        return ops.silu_mul(x)
    if select_backend(x, use_triton) == "triton":
        mod = layer_kernels()
        if mod is not None:
            return mod.silu_mul(x)
    return silu_mul_reference(x)
