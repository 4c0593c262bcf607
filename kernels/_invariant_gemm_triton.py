"""Triton GEMM ``y = x @ W^T (+ bias)`` whose every output row is computed the same way whatever
the row count. Imported lazily.

cuBLAS picks its algorithm (tile shape, split-K, tensor-core instruction) by the row count M, so
one sequence's logits change with the batch it runs in and with the drafts beside it. Here the
launch configuration depends on ``N`` and ``K`` only: program ``(m, n, s)`` multiplies ``BLOCK_M``
rows (padded with zeros; a row never reads another) by ``BLOCK_N`` weight rows over the ``s``-th
of ``SPLIT_K`` fixed, ``BLOCK_K``-aligned shares of K, with ``tl.dot`` at one tile shape; the
float32 partials are added in split order by :func:`kernels._gemv_triton._reduce_splits_kernel`
(no atomics). Each output element is then the same sequence of float operations at any M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gemv_triton import _reduce_splits_kernel

BLOCK_M = 16  # tl.dot's smallest row tile: one shape for every M
_REDUCE_BLOCK_N = 256


# num_rows changes every step; specialised on it (== 1, a multiple of 16) Triton would compile
# variants whose code differs by row count, which is what this kernel exists to avoid.
@triton.jit(do_not_specialize=["num_rows"])
def _invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
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
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP32_OPERANDS: tl.constexpr,
):
    """Program (m, n, s): row tile ``m`` times weight tile ``n`` over K share ``s``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < num_rows
    n_valid = offs_n < num_cols
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, k_dim)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if FP32_OPERANDS:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))

    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
    else:
        p_ptrs = part_ptr + ((pid_k * num_rows + offs_m[:, None]).to(tl.int64) * num_cols + offs_n[None, :])
        tl.store(p_ptrs, acc, mask=m_valid[:, None] & n_valid[None, :])


INTERPRETED: bool = type(_invariant_gemm_kernel).__name__ == "InterpretedFunction"


def invariant_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    split_k: int,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` → ``[M, N]`` in x's dtype, any M.

    ``split_k`` K shares (each a multiple of ``block_k``; at most one per chunk of K) and the
    blocks must come from N and K alone for the rows to be batch-invariant: the caller's job
    (:func:`kernels.invariant_linear.invariant_config`). x is cast to the weight's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    splits = max(1, min(split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    part = torch.empty((splits, rows, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else part  # never read without HAS_BIAS
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, block_n), splits)
    _invariant_gemm_kernel[grid](
        x, weight, bias_arg, out, part,
        rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=splits,
        HAS_BIAS=bias is not None,
        IEEE_DOT=INTERPRETED or weight.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 tiles as raw bits: feed it float32.
        FP32_OPERANDS=INTERPRETED,
    )
    if splits > 1:
        _reduce_splits_kernel[(triton.cdiv(n, _REDUCE_BLOCK_N), rows)](
            part, bias_arg, out,
            rows, n, out.stride(0),
            SPLIT_K=splits,
            SPLIT_POW2=triton.next_power_of_2(splits),
            BLOCK_N=_REDUCE_BLOCK_N,
            HAS_BIAS=bias is not None,
        )
    return out
