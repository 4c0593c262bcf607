"""RMSNorm with the residual add fused in: one kernel where a decoder layer had five or more.

``add_rmsnorm(x, residual, weight, eps)`` adds ``x`` into ``residual`` in place and returns
``weight * norm(residual)``; with ``residual=None`` it returns ``weight * norm(x)``. The
arithmetic is that of transformers' eager ``LlamaRMSNorm`` after a residual add in the model
dtype: the sum rounded to the dtype, the variance in float32, the normalised value rounded
before the weight multiplies it. :func:`add_rmsnorm_reference` is the torch oracle (and the
CPU path).
"""

from __future__ import annotations

import torch

from kernels._backend import layer_kernels, select_backend
from kernels.cpu_fused import cpu_fused_ops, fusable


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The torch oracle of :func:`add_rmsnorm` (same in-place update of ``residual``)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None,
    cpu_fused: bool = False,
) -> torch.Tensor:
    """``residual += x`` (in place, when given), then RMSNorm of the sum (or of ``x``) times
    ``weight``; x and residual [N, D] with a contiguous last dimension, weight [D]. Returns a
    new [N, D] tensor in x's dtype. ``use_triton`` follows :func:`kernels.select_backend`;
    ``cpu_fused``: float32 CPU tensors go through :mod:`kernels.cpu_fused` where it is built."""
    if cpu_fused and fusable(x, weight) and (ops := cpu_fused_ops()) is not None:
        return ops.add_rmsnorm(x, residual, weight, eps)  # checks the shapes itself
    _check(x, residual, weight)
    if select_backend(x, use_triton) == "triton":
        mod = layer_kernels()
        if mod is not None:
            return mod.add_rmsnorm(x, residual, weight, eps)
    return add_rmsnorm_reference(x, residual, weight, eps)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, D] with a contiguous last dimension, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
