"""Triton kernels and their launchers. Imported lazily (see ``kernels._backend``).

Launchers take already-validated tensors; the public dispatchers in ``kernels.bitmask``,
``kernels.dfa`` and ``kernels.penalties`` do the checking and pick this path or the
pure-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK_BLOCK = 4096  # vocab columns per program (a multiple of 32)
_ADVANCE_BLOCK = 128  # rows per program in dfa_advance
_PENALTY_BLOCK = 4096


@triton.jit
def _mask_rows_kernel(
    logits_ptr,
    logits_stride,
    words_ptr,
    words_stride,
    n_words,
    word_row_ptr,
    dst_row_ptr,
    n_cols,
    HAS_WORD_ROW: tl.constexpr,
    HAS_DST_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, b): sets -inf on banned columns of block b of one logits row.

    The bitmask row is ``word_row[r]`` (skipped when negative) or ``r``; the logits row is
    ``dst_row[r]`` or ``r``. Only banned columns are written; logits are never read.
    """
    r = tl.program_id(0)
    blk = tl.program_id(1)
    if HAS_WORD_ROW:
        wrow = tl.load(word_row_ptr + r).to(tl.int64)
    else:
        wrow = r.to(tl.int64)
    if wrow < 0:
        return
    if HAS_DST_ROW:
        drow = tl.load(dst_row_ptr + r).to(tl.int64)
    else:
        drow = r.to(tl.int64)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    word = cols // 32
    packed = tl.load(words_ptr + wrow * words_stride + word, mask=in_row & (word < n_words), other=0)
    banned = (((packed >> (cols % 32)) & 1) == 0) & in_row
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + drow * logits_stride + cols, neg_inf, mask=banned)


def mask_rows(
    logits: torch.Tensor,
    words: torch.Tensor,
    word_rows: torch.Tensor | None,
    dst_rows: torch.Tensor | None,
    n_programs_rows: int,
) -> None:
    """Launch ``_mask_rows_kernel`` over ``n_programs_rows`` bitmask rows."""
    n_cols = logits.shape[1]
    if n_programs_rows == 0 or n_cols == 0:
        return
    dummy = words  # never dereferenced when the matching HAS_* flag is False
    grid = (n_programs_rows, triton.cdiv(n_cols, _MASK_BLOCK))
    _mask_rows_kernel[grid](
        logits,
        logits.stride(0),
        words,
        words.stride(0),
        words.shape[1],
        word_rows if word_rows is not None else dummy,
        dst_rows if dst_rows is not None else dummy,
        n_cols,
        HAS_WORD_ROW=word_rows is not None,
        HAS_DST_ROW=dst_rows is not None,
        BLOCK=_MASK_BLOCK,
    )


@triton.jit
def _dfa_advance_kernel(
    states_ptr,
    tokens_ptr,
    offsets_ptr,
    trans_tokens_ptr,
    trans_next_ptr,
    out_ptr,
    n,
    n_iters,
    BLOCK: tl.constexpr,
):
    """Vectorised binary search of each row's token in its state's sorted CSR segment."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    state = tl.load(states_ptr + idx, mask=valid, other=-1)
    tok = tl.load(tokens_ptr + idx, mask=valid, other=0).to(tl.int32)
    alive = valid & (state >= 0)
    lo = tl.load(offsets_ptr + state, mask=alive, other=0)
    end = tl.load(offsets_ptr + state + 1, mask=alive, other=0)
    hi = end
    for _ in range(n_iters):
        active = lo < hi
        mid = (lo + hi) // 2
        t = tl.load(trans_tokens_ptr + mid, mask=active, other=0)
        right = t < tok
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (~right), mid, hi)
    hit = alive & (lo < end)
    t = tl.load(trans_tokens_ptr + lo, mask=hit, other=-1)
    hit = hit & (t == tok)
    nxt = tl.load(trans_next_ptr + lo, mask=hit, other=-1)
    tl.store(out_ptr + idx, tl.where(hit, nxt, -1), mask=valid)


def dfa_advance(
    states: torch.Tensor,
    tokens: torch.Tensor,
    trans_offsets: torch.Tensor,
    trans_tokens: torch.Tensor,
    trans_next: torch.Tensor,
    n_iters: int,
) -> torch.Tensor:
    """Launch ``_dfa_advance_kernel``; returns new int32 states."""
    out = torch.empty_like(states)
    n = states.numel()
    if n == 0:
        return out
    grid = (triton.cdiv(n, _ADVANCE_BLOCK),)
    _dfa_advance_kernel[grid](
        states, tokens, trans_offsets, trans_tokens, trans_next, out, n, n_iters,
        BLOCK=_ADVANCE_BLOCK,
    )
    return out


@triton.jit
def _penalties_kernel(
    logits_ptr,
    logits_stride,
    rows_ptr,
    slots_ptr,
    counts_ptr,
    counts_stride,
    prompt_ptr,
    prompt_stride,
    rep_ptr,
    pres_ptr,
    freq_ptr,
    inv_temp_ptr,
    n_cols,
    HAS_ROWS: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Repetition, frequency and presence penalties (then temperature) on one row block."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    ptrs = logits_ptr + row * logits_stride + cols
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    cnt = tl.load(counts_ptr + slot * counts_stride + cols, mask=m, other=0)
    in_prompt = tl.load(prompt_ptr + slot * prompt_stride + cols, mask=m, other=0)
    rep = tl.load(rep_ptr + r)
    seen = (cnt > 0) | (in_prompt != 0)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - tl.load(freq_ptr + r) * cnt.to(tl.float32)
    x = x - tl.load(pres_ptr + r) * (cnt > 0).to(tl.float32)
    if HAS_TEMP:
        x = x * tl.load(inv_temp_ptr + r)
    tl.store(ptrs, x.to(logits_ptr.dtype.element_ty), mask=m)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    inv_temperature: torch.Tensor | None,
) -> None:
    """Launch ``_penalties_kernel`` over ``slots.numel()`` rows."""
    n_rows, n_cols = slots.numel(), logits.shape[1]
    if n_rows == 0 or n_cols == 0:
        return
    grid = (n_rows, triton.cdiv(n_cols, _PENALTY_BLOCK))
    _penalties_kernel[grid](
        logits, logits.stride(0),
        rows if rows is not None else slots,
        slots,
        counts, counts.stride(0),
        prompt_mask, prompt_mask.stride(0),
        repetition, presence, frequency,
        inv_temperature if inv_temperature is not None else repetition,
        n_cols,
        HAS_ROWS=rows is not None,
        HAS_TEMP=inv_temperature is not None,
        BLOCK=_PENALTY_BLOCK,
    )


# True when this module was imported with TRITON_INTERPRET=1: the kernels above are then
# interpreter objects (run on host tensors) for the life of the process.
INTERPRETED: bool = type(_mask_rows_kernel).__name__ == "InterpretedFunction"
