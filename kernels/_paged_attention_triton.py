"""Triton varlen paged attention: one launch for a whole step's rows. Imported lazily.

Program ``(t, g)`` handles one *query tile* (up to ``BLOCK_Q`` consecutive new tokens of one
row) against kv head ``g``; the tile's ``BLOCK_Q × GROUP`` (token, query head) pairs sharing
that kv head are stacked into the ``BLOCK_M`` rows of one matrix, so GQA reads each key once
per tile. Row ``r`` owns tiles ``query_start[r] // BLOCK_Q + r ..`` (one spare tile per row
bounds the grid at ``N // BLOCK_Q + R`` from shapes alone); a program finds its row by binary
search over ``query_start`` and exits when its tile lies past the row's queries. Keys are
walked ``TILE_N`` positions at a time with an online softmax; loop bounds come from
``context_lens`` inside the kernel, so the launch depends only on tensor shapes and can be
captured in a CUDA graph. The same tiling is used by vLLM's unified Triton attention.

With ``HAS_LIMITS`` each query also reads its last visible key position (``visible_until``, at
least its own): the tile's key loop runs to the largest of its queries' limits (within the row's
context) and each query masks the keys past its own. Without it, nothing of this is compiled in.

Small decode-only steps also split each tile's keys over ``NUM_SPLITS`` programs (grid axis 2;
flash-decoding): each stores its unnormalised partial state and ``_merge_splits_kernel``
rescales them to one maximum, adds the sink and normalises.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """tanh from exp (portable to the interpreter); saturates cleanly at ±1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


INTERPRETED: bool = type(_tanh).__name__ == "InterpretedFunction"


@triton.jit
def _first_tile(query_start_ptr, row, BLOCK_Q: tl.constexpr):
    """Index of row ``row``'s first query tile (a spare tile per row unless tiles are tokens)."""
    if BLOCK_Q == 1:
        return tl.load(query_start_ptr + row)
    else:
        return tl.load(query_start_ptr + row) // BLOCK_Q + row


@triton.jit
def _find_row(query_start_ptr, tile, num_rows, BLOCK_Q: tl.constexpr):
    """Largest row r whose first tile is ``<= tile`` (binary search over ``query_start``)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_tile(query_start_ptr, mid, BLOCK_Q) <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The step's row count and block-table width change from step to step; specialised (equal to
# 1, a multiple of 16) they compiled new variants inside served steps, for nothing measurable.
@triton.jit(do_not_specialize=["num_rows", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    sinks_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    visible_until_ptr,
    num_rows,
    num_heads,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    scale,
    softcap,
    sliding_window,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FP32_OPERANDS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LIMITS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = _find_row(query_start_ptr, tile, num_rows, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_begin
    local_tile = tile - _first_tile(query_start_ptr, row, BLOCK_Q)
    if local_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + row)
    first_pos = ctx_len - q_len  # position of the row's first new token

    offs_m = tl.arange(0, BLOCK_M)
    q_local = local_tile * BLOCK_Q + offs_m // GROUP  # token index within the row
    head = kv_head * GROUP + offs_m % GROUP
    m_valid = (offs_m // GROUP < BLOCK_Q) & (q_local < q_len) & (head < num_heads)
    q_pos = first_pos + q_local
    offs_d = tl.arange(0, HEAD_DIM)
    d_valid = offs_d < head_dim

    q_token = (q_begin + q_local).to(tl.int64)
    q_ptrs = query_ptr + q_token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if FP32_OPERANDS:
        q = q.to(tl.float32)

    if HAS_SINKS and NUM_SPLITS == 1:  # split partials get their sink in _merge_splits_kernel
        m_i = tl.load(sinks_ptr + head, mask=m_valid, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(m_valid, 1.0, 0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    last_local = tl.minimum(local_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_end = first_pos + last_local + 1  # exclusive: the tile's last query sees keys < key_end
    q_last = q_pos  # the last key each query sees
    if HAS_LIMITS:
        limit = tl.load(visible_until_ptr + q_token, mask=m_valid, other=0).to(tl.int32)
        q_last = tl.maximum(q_pos, limit)
        farthest = tl.max(tl.where(m_valid, q_last + 1, 0), axis=0)
        key_end = tl.minimum(tl.maximum(key_end, farthest), ctx_len)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(first_pos + local_tile * BLOCK_Q - sliding_window + 1, 0)
        key_begin = (key_begin // TILE_N) * TILE_N
    key_stop = key_end
    if NUM_SPLITS > 1:  # this program takes one TILE_N-aligned share of the keys
        split = tl.program_id(2)
        share = tl.cdiv(tl.cdiv(key_end - key_begin, NUM_SPLITS), TILE_N) * TILE_N
        key_begin = key_begin + split * share
        key_stop = tl.minimum(key_begin + share, key_end)
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    for n_start in range(key_begin, key_stop, TILE_N):
        k_pos = n_start + offs_n
        n_valid = k_pos < key_end
        block = tl.load(bt_row + k_pos // block_size, mask=n_valid, other=0).to(tl.int64)
        slot = (k_pos % block_size).to(tl.int64)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        if FP32_OPERANDS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = s * 1.4426950408889634  # exp2 below
        visible = m_valid[:, None] & n_valid[None, :] & (k_pos[None, :] <= q_last[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:  # unnormalised partials [N, heads, NUM_SPLITS, (HEAD_DIM)], log2 units
        part = (q_token * num_heads + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(part_m_ptr + part, m_i, mask=m_valid)
        tl.store(part_l_ptr + part, l_i, mask=m_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_valid[:, None])
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + q_token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (token, head): rescale the split partials to one max, add the sink, normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row: nothing anywhere
    weight = tl.exp2(m - m_safe)
    total = tl.sum(l * weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    merged = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    num_kv_splits: int | None = None,
    visible_until: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernel; the grid depends only on shapes (CUDA-graph capturable).

    ``visible_until`` [N] (int32 or int64; None: causal): each query's last visible key position
    (see :attr:`kernels.paged_attention.PagedAttentionMetadata.visible_until`).

    When every row is a decode row by shape (``N == R``), or a kv head has 16+ query heads,
    a tile holds one token and needs no spare tile per row. ``num_kv_splits`` (a power of two;
    None: :func:`auto_kv_splits`) splits each tile's keys over that many programs whose partial
    softmax states a second kernel merges (flash-decoding), for steps too small to fill the GPU.
    """
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("paged attention needs caches and block tables contiguous in their last dim")
    out = torch.empty_like(query)  # in the query's dtype, whatever the cache holds
    if query.dtype != k_cache.dtype:
        query = query.to(k_cache.dtype)
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    num_rows = block_tables.shape[0]
    group = num_heads // kv_heads
    if num_tokens == 0 or num_rows == 0:
        return out
    block_m = max(16, triton.next_power_of_2(group))
    block_q = 1 if num_tokens == num_rows else max(1, block_m // group)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_rows
    splits = auto_kv_splits(query, num_rows, kv_heads) if num_kv_splits is None else num_kv_splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {splits}")
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    part_shape = (num_tokens, num_heads, splits) if splits > 1 else (1,)
    part_m = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_l = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_acc = torch.empty((*part_shape, head_dim_pad), dtype=torch.float32, device=query.device)
    grid = (num_tiles, kv_heads, splits)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        sinks if sinks is not None else query,
        part_acc,
        part_m,
        part_l,
        block_tables,
        context_lens,
        query_start,
        visible_until if visible_until is not None else query_start,
        num_rows,
        num_heads,
        head_dim,
        block_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=32 if head_dim <= 128 else 16,
        HEAD_DIM=head_dim_pad,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=bool(softcap),
        HAS_WINDOW=sliding_window is not None,
        IEEE_DOT=query.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 tiles as raw bits (3.9): feed it float32.
        FP32_OPERANDS=INTERPRETED and query.dtype == torch.bfloat16,
        NUM_SPLITS=splits,
        HAS_LIMITS=visible_until is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            sinks if sinks is not None else part_m,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            HEAD_DIM=head_dim_pad,
            HAS_SINKS=sinks is not None,
        )
    return out


_MAX_KV_SPLITS = 16


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_kv_splits(query: torch.Tensor, num_rows: int, kv_heads: int) -> int:
    """Key splits for a step, from shapes only: a decode-only step (``N == R``) with fewer
    ``rows × kv_heads`` programs than twice the SM count gets enough splits (a power of two,
    at most 16) to fill it; everything else, and the interpreter, runs unsplit."""
    num_tokens = query.shape[0]
    if INTERPRETED or not query.is_cuda or num_tokens != num_rows:
        return 1
    programs = num_tokens * kv_heads
    target = 2 * _sm_count(query.device.index if query.device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    return min(_MAX_KV_SPLITS, triton.next_power_of_2(triton.cdiv(target, programs)))


