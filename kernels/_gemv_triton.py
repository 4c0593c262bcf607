"""Triton GEMMs ``y = x @ W^T (+ bias)``: split-K for decode's 1-8 rows, and row tiles of any M
for the batch-invariant linear. Imported lazily.

Program ``(m, n, s)`` owns ``BLOCK_M`` rows (``m``), ``BLOCK_N`` output columns and the
``s``-th of ``SPLIT_K`` equal, ``BLOCK_K``-aligned shares of the reduction dim. :func:`gemv`
launches one row tile for *all* rows of ``x``, so every weight element is read from memory
exactly once per call. Rows are padded to ``BLOCK_M`` (a power of two): up to 4 rows multiply
on the CUDA cores (a broadcast product summed over K), more go through ``tl.dot`` with the rows
padded to 16. :func:`gemm_rows` launches row tiles of a fixed shape over any M, unsplit, with
``tl.dot``: each output element is then one float32 sum over K in ``BLOCK_K`` chunks, in order,
whatever M is (:mod:`kernels.invariant_linear`).

With ``SPLIT_K == 1`` the program adds the bias, casts and stores the output itself. Otherwise
each program stores its float32 partial sums in ``[SPLIT_K, M, N]`` and
``_reduce_splits_kernel`` adds them up in a fixed order (deterministic, unlike atomics), adds
the bias and casts: two launches whose grids depend only on shapes (CUDA-graph capturable).

Interpreter note (Triton 3.9): casting float32 to bfloat16 truncates there instead of
rounding to nearest, so interpreted bfloat16 outputs may sit one ulp below the compiled ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # the most rows of x one launch takes
_DOT_BLOCK_M = 16  # tl.dot's smallest row tile
_MAX_REDUCE_ROWS = 4  # more rows than this multiply with tl.dot


# num_rows changes every step; specialised on it (== 1, a multiple of 16) Triton would compile
# variants by row count, and the batch-invariant linear must run one code for every M.
@triton.jit(do_not_specialize=["num_rows"])
def _gemv_splitk_kernel(
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
    USE_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP32_OPERANDS: tl.constexpr,
):
    """Program (m, n, s): float32 sums of row tile ``m`` over K share ``s`` for N block ``n``."""
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
        if USE_DOT:
            if FP32_OPERANDS:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE_DOT:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)

    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
    else:
        p_ptrs = part_ptr + ((pid_k * num_rows + offs_m[:, None]).to(tl.int64) * num_cols + offs_n[None, :])
        tl.store(p_ptrs, acc, mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _reduce_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_om,
    SPLIT_K: tl.constexpr,
    SPLIT_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Program (n, m): sum row ``m``'s ``SPLIT_K`` partials over N block ``n``, add bias, cast."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_s = tl.arange(0, SPLIT_POW2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < num_cols
    p_ptrs = part_ptr + ((offs_s[:, None] * num_rows + row).to(tl.int64) * num_cols + offs_n[None, :])
    parts = tl.load(p_ptrs, mask=(offs_s[:, None] < SPLIT_K) & n_valid[None, :], other=0.0)
    total = tl.sum(parts, axis=0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + row.to(tl.int64) * stride_om + offs_n
    tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_valid)


INTERPRETED: bool = type(_gemv_splitk_kernel).__name__ == "InterpretedFunction"

_REDUCE_BLOCK_N = 256


def block_m(rows: int) -> int:
    """Row tile for ``rows`` rows: the next power of two, or 16 (``tl.dot``) past 4 rows."""
    return triton.next_power_of_2(max(rows, 1)) if rows <= _MAX_REDUCE_ROWS else _DOT_BLOCK_M


def effective_split(k: int, split_k: int, block_k: int) -> int:
    """``split_k`` capped so every split gets at least one ``block_k`` chunk of K."""
    return max(1, min(split_k, triton.cdiv(k, block_k)))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    split_k: int,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N])`` → ``[M, N]`` in x's dtype; ``M <= 8``.

    ``block_n`` and ``block_k`` are powers of two (16 or more when ``M > 4``); ``split_k`` is
    capped by :func:`effective_split`. x is cast to the weight's dtype when they differ.
    """
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {rows}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    x = _operand(x, weight.dtype)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    splits = effective_split(k, split_k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    part = torch.empty((splits, rows, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else part  # never read without HAS_BIAS
    use_dot = rows > _MAX_REDUCE_ROWS
    _gemv_splitk_kernel[(1, triton.cdiv(n, block_n), splits)](
        x, weight, bias_arg, out, part,
        rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=splits,
        HAS_BIAS=bias is not None,
        USE_DOT=use_dot,
        IEEE_DOT=INTERPRETED or weight.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 tiles as raw bits (3.9): feed it float32.
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


def _operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the weight's dtype with unit stride along K."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def gemm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: tuple[int, int, int],
    block_k: int,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias [N])`` → ``[M, N]`` in x's dtype, any M, unsplit.

    ``tile`` is ``(BLOCK_M, BLOCK_N, num_warps)`` (blocks powers of two, 16 or more): it places
    the sums, ``block_k`` orders them (see :mod:`kernels.invariant_linear`)."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    x = _operand(x, weight.dtype)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_m, block_n, warps = tile
    _gemv_splitk_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n), 1)](
        x, weight, bias if bias is not None else out, out, out,
        rows, n, k, triton.cdiv(k, block_k) * block_k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=1,
        HAS_BIAS=bias is not None,
        USE_DOT=True,
        IEEE_DOT=INTERPRETED or weight.dtype == torch.float32,
        FP32_OPERANDS=INTERPRETED,
        num_warps=warps,
    )
    return out
