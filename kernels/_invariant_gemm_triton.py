"""Triton GEMM ``y = x @ W^T (+ bias)`` whose every output row is computed the same way whatever
the row count. Imported lazily.

cuBLAS picks its algorithm (tile shape, split-K, tensor-core instruction) by the row count M, so
one sequence's logits change with the batch it runs in and with the drafts beside it. Here each
output element is one float32 accumulation over K in ``BLOCK_K`` chunks, in order, with no K split
and no atomics: program ``(m, n)`` multiplies ``BLOCK_M`` rows (padded with zeros; a row never
reads another) by ``BLOCK_N`` weight rows. ``BLOCK_K`` is the only block that orders the sums;
the row and column tiles (and the warps) only place them, and may follow M for speed where the
device computes the same bits with them (:func:`kernels.invariant_linear.agreeing_tiles` checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# num_rows changes every step; specialised on it (== 1, a multiple of 16) Triton would compile
# variants whose code differs by row count, which is what this kernel exists to avoid.
@triton.jit(do_not_specialize=["num_rows"])
def _invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    k_dim,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP32_OPERANDS: tl.constexpr,
):
    """Program (m, n): row tile ``m`` times weight tile ``n`` over all of K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < num_rows
    n_valid = offs_n < num_cols
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k_dim, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_dim
        x = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if FP32_OPERANDS:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


INTERPRETED: bool = type(_invariant_gemm_kernel).__name__ == "InterpretedFunction"


def invariant_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: tuple[int, int, int],
    block_k: int,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` → ``[M, N]`` in x's dtype, any M.

    ``tile`` is ``(BLOCK_M, BLOCK_N, num_warps)`` (powers of two, blocks 16 or more); ``block_k``
    must not depend on M for the rows to be batch-invariant. x is cast to the weight's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_m, block_n, warps = tile
    _invariant_gemm_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n))](
        x, weight, bias if bias is not None else out, out,
        rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        IEEE_DOT=INTERPRETED or weight.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 tiles as raw bits: feed it float32.
        FP32_OPERANDS=INTERPRETED,
        num_warps=warps,
    )
    return out
