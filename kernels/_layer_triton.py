"""Triton kernels of a decoder layer's glue: fused residual add + RMSNorm, qk-norm + rotary +
KV-cache write, SiLU·mul. Imported lazily (see ``kernels._backend``).

Every kernel computes in float32 and rounds to the tensors' dtype wherever transformers'
eager modules round (after each elementwise op), so a bfloat16 model gives the values of its
eager forward up to the order of the RMSNorm's sum. Launchers take validated tensors; the
public dispatchers in ``kernels.rmsnorm``, ``kernels.rotary`` and ``kernels.activation`` check
them and pick this path or the pure-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SILU_BLOCK = 1024


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to the model dtype and back: where an eager op would store it."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row ``r``: (residual[r] += x[r]); out[r] = w * norm(residual[r]) (or of x[r] alone)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=inside, other=0.0).to(tl.float32)
        h = _round(h + r, dtype)
        tl.store(res_ptr + row * res_stride + cols, h.to(dtype), mask=inside)
    variance = tl.sum(h * h, axis=0) / n_cols
    normed = _round(h * tl.math.rsqrt(variance + eps), dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(dtype), mask=inside)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch ``_add_rmsnorm_kernel`` over the rows of 2-d ``x`` (last dim contiguous)."""
    rows, cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out
    res = residual if residual is not None else x
    _add_rmsnorm_kernel[(rows,)](
        x, x.stride(0), res, res.stride(0), weight, out, out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
    )
    return out


@triton.jit
def _head_rms(x1, x2, w_ptr, half, BLOCK_HALF: tl.constexpr, head_dim, eps, DTYPE: tl.constexpr):
    """One head's RMSNorm (Qwen3's qk-norm) on its two halves ``x1``, ``x2`` (float32)."""
    cols = tl.arange(0, BLOCK_HALF)
    inside = cols < half
    variance = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / head_dim
    inv = tl.math.rsqrt(variance + eps)
    w1 = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + cols, mask=inside, other=0.0).to(tl.float32)
    return _round(w1 * _round(x1 * inv, DTYPE), DTYPE), _round(w2 * _round(x2 * inv, DTYPE), DTYPE)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, qkv_stride, cos_ptr, sin_ptr, cs_stride, slot_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, cache_slot_stride, q_norm_ptr, k_norm_ptr, eps,
    num_heads, num_kv_heads, head_dim, half,
    HAS_QK_NORM: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Program (token t, head h) over the q, k then v heads of ``qkv[t]``: q heads are normed,
    rotated and stored into ``q``; k heads normed, rotated and stored at the token's cache slot;
    v heads stored at the slot as they are."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    inside = cols < half
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + t * qkv_stride + head * head_dim
    x1 = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols, mask=inside, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if head >= num_heads + num_kv_heads:  # a value head: no rotation
        dst = v_cache_ptr + slot * cache_slot_stride + (head - num_heads - num_kv_heads) * head_dim
        tl.store(dst + cols, x1.to(v_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + half + cols, x2.to(v_cache_ptr.dtype.element_ty), mask=inside)
    else:
        is_query = head < num_heads
        if HAS_QK_NORM:
            if is_query:
                x1, x2 = _head_rms(x1, x2, q_norm_ptr, half, BLOCK_HALF, head_dim, eps, dtype)
            else:
                x1, x2 = _head_rms(x1, x2, k_norm_ptr, half, BLOCK_HALF, head_dim, eps, dtype)
        c1 = tl.load(cos_ptr + t * cs_stride + cols, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * cs_stride + half + cols, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * cs_stride + cols, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * cs_stride + half + cols, mask=inside, other=0.0).to(tl.float32)
        y1 = _round(_round(x1 * c1, dtype) + _round(-x2 * s1, dtype), dtype)
        y2 = _round(_round(x2 * c2, dtype) + _round(x1 * s2, dtype), dtype)
        if is_query:
            dst = q_ptr + (t * num_heads + head) * head_dim
            tl.store(dst + cols, y1.to(dtype), mask=inside)
            tl.store(dst + half + cols, y2.to(dtype), mask=inside)
        else:
            dst = k_cache_ptr + slot * cache_slot_stride + (head - num_heads) * head_dim
            tl.store(dst + cols, y1.to(k_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(dst + half + cols, y2.to(k_cache_ptr.dtype.element_ty), mask=inside)


def rope_write_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
) -> torch.Tensor:
    """Launch ``_rope_write_kv_kernel`` over ``qkv``'s tokens; returns q [N, heads, head_dim]."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = head_dim // 2
    norm = q_norm if q_norm is not None else cos
    _rope_write_kv_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, qkv.stride(0), cos, sin, cos.stride(0), slot_mapping,
        q, k_cache, v_cache, k_cache.stride(1), norm, k_norm if k_norm is not None else norm, eps,
        num_heads, num_kv_heads, head_dim, half,
        HAS_QK_NORM=q_norm is not None, BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q


@triton.jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, width, BLOCK: tl.constexpr):
    """Program (row, block): out = silu(gate) * up, gate and up the two halves of ``x[row]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=inside, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=inside)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Launch ``_silu_mul_kernel`` over 2-d ``x`` [N, 2 * I]; returns [N, I]."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    _silu_mul_kernel[(rows, triton.cdiv(width, _SILU_BLOCK))](
        x, x.stride(0), out, out.stride(0), width, BLOCK=_SILU_BLOCK,
    )
    return out


INTERPRETED: bool = type(_silu_mul_kernel).__name__ == "InterpretedFunction"
