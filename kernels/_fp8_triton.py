"""Triton kernel of :func:`kernels.fp8.quantize_rows`: a row of activations to FP8 e4m3 with its
float32 scale, one program per row (two passes over the row when the scale is dynamic: the
absolute maximum, then the scaled cast). Imported lazily."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE

_BLOCK = 1024
_ONE_BLOCK_MAX = 16384  # rows up to this long are quantized in one read


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_scale_ptr,
    k_dim,
    stride_x,
    stride_q,
    scale_ub,
    fp8_max,
    min_scale,
    STATIC: tl.constexpr,
    HAS_UB: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """Program m: row m of x to FP8 in q, its scale in scale[m] (a row that fits one block is
    read once)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_BLOCK:
        offs = tl.arange(0, BLOCK)
        values = tl.load(x_row + offs, mask=offs < k_dim, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_scale_ptr).to(tl.float32)
        else:
            amax = tl.max(tl.abs(values), axis=0)
            if HAS_UB:
                amax = tl.minimum(amax, scale_ub)
            scale = tl.maximum(amax / fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        scaled = tl.minimum(tl.maximum(values / scale, -fp8_max), fp8_max)
        tl.store(q_row + offs, scaled.to(q_ptr.dtype.element_ty), mask=offs < k_dim)
        return
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k_dim, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            values = tl.load(x_row + offs, mask=offs < k_dim, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(values))
        amax = tl.max(peak, axis=0)
        if HAS_UB:
            amax = tl.minimum(amax, scale_ub)
        scale = tl.maximum(amax / fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, k_dim, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        values = tl.load(x_row + offs, mask=offs < k_dim, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(values / scale, -fp8_max), fp8_max)
        tl.store(q_row + offs, scaled.to(q_ptr.dtype.element_ty), mask=offs < k_dim)


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None,
                  scale_ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) → (FP8 [M, K], float32 scales [M, 1])."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    static = input_scale if input_scale is not None else scale  # never read unless STATIC
    one_block = k <= _ONE_BLOCK_MAX
    _quantize_rows_kernel[(rows,)](
        x, q, scale, static,
        k, x.stride(0), q.stride(0),
        float(scale_ub or 0.0), FP8_MAX, MIN_SCALE,
        STATIC=input_scale is not None,
        HAS_UB=scale_ub is not None,
        BLOCK=triton.next_power_of_2(k) if one_block else _BLOCK,
        ONE_BLOCK=one_block,
        num_warps=max(4, min(16, triton.next_power_of_2(k) // 1024)) if one_block else 4,
    )
    return q, scale


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    x_scale_ptr,
    out_ptr,
    num_rows,
    num_cols,
    k_dim,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    X_SCALE: tl.constexpr,
):
    """Program (n, s): rows of x times the FP8 rows of N block n over K share s, times the
    weight's scales; stored (SPLIT_K 1) or as float32 partial sums [SPLIT_K, M, N]. Without
    ``tl.dot`` the products accumulate per K lane and are summed once after the loop. With
    ``X_SCALE`` x is FP8 too (quantized rows, scales in x_scale): an FP8 x FP8 ``tl.dot``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < num_rows
    n_valid = offs_n < num_cols
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, k_dim)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if USE_DOT or X_SCALE:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        lanes = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if X_SCALE:
            acc += tl.dot(x, tl.trans(w))
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            lanes += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not (USE_DOT or X_SCALE):
        acc = tl.sum(lanes, axis=2)
    acc *= tl.load(scale_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    if X_SCALE:
        acc *= tl.load(x_scale_ptr + offs_m, mask=m_valid, other=0.0)[:, None]
    o_ptrs = out_ptr + (pid_k * num_rows + offs_m[:, None]).to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, num_rows, num_cols, SPLIT_K: tl.constexpr, SPLIT_POW2: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Program (n, m): row m's SPLIT_K partial sums over N block n, added in a fixed order and cast."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_s = tl.arange(0, SPLIT_POW2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < num_cols
    p_ptrs = part_ptr + (offs_s[:, None] * num_rows + row).to(tl.int64) * num_cols + offs_n[None, :]
    parts = tl.load(p_ptrs, mask=(offs_s[:, None] < SPLIT_K) & n_valid[None, :], other=0.0)
    total = tl.sum(parts, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * num_cols + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_valid)


_SUM_BLOCK_N = 256
DOT_ROWS = 4  # more rows than this multiply with tl.dot (rows padded to 16, 32 or 64)


def gemv_block_m(rows: int) -> int:
    """Row tile: the next power of two (at least 16 past :data:`DOT_ROWS` rows, for ``tl.dot``)."""
    tile = triton.next_power_of_2(max(rows, 1))
    return tile if rows <= DOT_ROWS else max(tile, 16)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, split_k: int, block_n: int,
             block_k: int, num_warps: int = 4, x_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] * scale [N])^T`` in ``out_dtype`` (default x's; x bf16/fp16/fp32,
    weight FP8, M <= 64): the weight read once, in FP8; ``split_k`` K shares summed in float32.
    ``x_scale`` [M]: x holds FP8 rows with these scales (an FP8 ``tl.dot``, rows padded to 16)."""
    out_dtype = out_dtype or x.dtype
    rows, k = x.shape
    n = weight.shape[0]
    tile = gemv_block_m(rows)
    if x_scale is not None:  # an FP8 tl.dot: at least 16 rows
        tile = max(tile, 16)
    splits = max(1, min(split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    target = torch.empty((splits, rows, n), dtype=out_dtype if splits == 1 else torch.float32, device=x.device)
    if rows:
        _fp8_gemv_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, scale, x_scale if x_scale is not None else scale, target,
            rows, n, k, k_per_split,
            x.stride(0), weight.stride(0), target.stride(1),
            BLOCK_M=tile, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits,
            USE_DOT=tile > DOT_ROWS and x.dtype != torch.float32,
            X_SCALE=x_scale is not None,
            num_warps=num_warps,
        )
    if splits == 1:
        return target[0]
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if rows:
        _sum_splits_kernel[(triton.cdiv(n, _SUM_BLOCK_N), rows)](
            target, out, rows, n, SPLIT_K=splits, SPLIT_POW2=triton.next_power_of_2(splits), BLOCK_N=_SUM_BLOCK_N)
    return out
