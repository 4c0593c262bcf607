"""A layer's attention inputs in one kernel: split the fused q/k/v projection, apply the
optional per-head RMSNorm (Qwen3's qk-norm) and the rotary embedding, store the keys and values
at their cache slots, and return the rotated queries.

``qkv`` [N, (heads + 2 * kv_heads) * head_dim] holds each token's query heads, then key heads,
then value heads (the row layout of the concatenated projection). ``cos``/``sin`` [N, head_dim]
are transformers' rotary tables at the tokens' positions (both halves, in the model dtype), so
every rope scaling transformers computes is applied as it computes it; the rotation is
``x * cos + rotate_half(x) * sin`` with the eager rounding. The cache layout is the paged
``[blocks, block_size, kv_heads, head_dim]`` of :mod:`kernels.paged_attention`.
"""

from __future__ import annotations

import torch

from kernels._backend import layer_kernels, select_backend
from kernels.cpu_fused import cpu_fused_ops, fusable
from kernels.paged_attention import write_kv
from kernels.rmsnorm import add_rmsnorm_reference


def rope_write_kv_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor:
    """The torch oracle of :func:`rope_write_kv` (the CPU path)."""
    head_dim = k_cache.shape[-1]
    tokens = qkv.shape[0]
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, d]
    if q_norm is None:  # queries and keys rotate as one tensor: the same elementwise ops, half the calls
        qk = qk.view(tokens, num_heads + num_kv_heads, head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, :num_heads], qk[:, num_heads:]
    else:  # per head: the norm is over the last dimension
        q, k = qk.split([num_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = add_rmsnorm_reference(q.view(tokens, num_heads, head_dim), None, q_norm, eps)
        k = add_rmsnorm_reference(k.view(tokens, num_kv_heads, head_dim), None, k_norm, eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
    write_kv(k_cache, v_cache, k, v.view(tokens, num_kv_heads, head_dim), slot_mapping)
    return q


def rope_write_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
    *, use_triton: bool | None = None, cpu_fused: bool = False,
) -> torch.Tensor:
    """Rotate and cache one step's keys, store its values, return its queries [N, heads, head_dim]
    (see the module docstring). ``q_norm``/``k_norm`` [head_dim]: both or neither. ``cpu_fused``:
    float32 CPU tensors without a qk-norm go through :mod:`kernels.cpu_fused` where it is built."""
    if cpu_fused and q_norm is None and fusable(qkv, cos, sin, k_cache, v_cache) \
            and (ops := cpu_fused_ops()) is not None:  # checks the shapes itself
        return ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    head_dim = _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, q_norm, k_norm)
    if select_backend(qkv, use_triton) == "triton":
        mod = layer_kernels()
        if mod is not None:
            return mod.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                     head_dim, q_norm, k_norm, eps)
    return rope_write_kv_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                   q_norm, k_norm, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, q_norm, k_norm) -> int:
    """Shape agreement (no device sync); returns head_dim."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"caches must be [blocks, block_size, {num_kv_heads}, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    head_dim = k_cache.shape[3]
    tokens = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [N, {width}] with a contiguous last dimension, got {tuple(qkv.shape)}")
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {head_dim}] (even), got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(0) != cos.stride(0) or sin.stride(-1) != 1:
        raise ValueError("cos and sin must share one row stride with contiguous rows")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping must be [{tokens}], got {tuple(slot_mapping.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("the caches must be contiguous")
    return head_dim
