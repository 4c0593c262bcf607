"""Batched logits-processing and sampling steps (pure torch, no host sync).

Each function works on the rows ``idx`` of ``x`` [B, V] (float32, modified in place);
``idx=None`` means all rows (no gather/scatter).
"""

from __future__ import annotations

import torch

from kernels.cpu_fused import vectorised_cpu_ops

NEG_INF = float("-inf")


def take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows ``idx`` of ``x`` (a copy), or ``x`` itself."""
    return x if idx is None else x.index_select(0, idx)


def put(x: torch.Tensor, idx: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Write ``rows`` back to ``x[idx]`` (no-op when ``rows`` is ``x``)."""
    if idx is not None:
        x.index_copy_(0, idx, rows)


def top_k_inplace(x: torch.Tensor, idx: torch.Tensor | None, k: torch.Tensor, k_max: int) -> None:
    """Keep tokens whose logit >= the row's k-th largest (ties kept). k: [R] long, 1 <= k <= V."""
    rows = take(x, idx)  # [R, V]
    kth = rows.topk(k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    rows.masked_fill_(rows < kth, NEG_INF)
    put(x, idx, rows)


def top_k_top_p_inplace(x: torch.Tensor, idx: torch.Tensor | None, k: torch.Tensor, p: torch.Tensor) -> None:
    """Top-k (k: [R], V = off) then top-p (p: [R]) on one sort.

    Top-p keeps the shortest prefix of tokens (sorted by logit) whose probability (after
    top-k) reaches ``p`` (at least one token), plus any token tied with the last one kept.
    """
    rows = take(x, idx)  # [R, V]
    srt = rows.sort(dim=-1, descending=True).values  # [R, V]
    threshold = top_k_top_p_threshold(srt, k, p)  # [R, 1]
    rows.masked_fill_(rows < threshold, NEG_INF)
    put(x, idx, rows)


def top_k_top_p_threshold(srt: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[R, 1] smallest logit top-k then top-p keep (see :func:`top_k_top_p_inplace`), from the
    rows sorted descending ``srt`` [R, V] (overwritten: positions past k become -inf)."""
    pos = torch.arange(srt.shape[1], device=srt.device)
    srt.masked_fill_(pos.unsqueeze(0) >= k.unsqueeze(1), NEG_INF)
    probs = srt.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # exclusive prefix mass
    keep = (before < p.unsqueeze(1)) & (srt > NEG_INF)
    keep[:, 0] = True
    n_keep = keep.sum(dim=-1, keepdim=True)  # [R, 1]; keep is a prefix
    return srt.gather(1, n_keep - 1)


def truncate_rows_inplace(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, log_min_p: torch.Tensor) -> None:
    """Top-k, top-p and min-p on every row of ``x`` [B, V] at once, with per-row parameters and
    no host sync (static shapes, for CUDA graphs). k: [B] long (V = off); p: [B] float32
    (>= 1 = off); log_min_p: [B] float32 (-inf = off).

    Row by row the cut is the one the per-group functions make: a top-k-only row keeps what
    :func:`top_k_inplace` keeps (the k-th largest value is the same element of the sort), a
    top-p row what :func:`top_k_top_p_inplace` keeps (the same threshold function), then
    :func:`min_p_inplace`; a row with every step off is left unchanged."""
    srt = x.sort(dim=-1, descending=True).values  # [B, V]
    kth = srt.gather(1, (k - 1).unsqueeze(1))  # [B, 1]; the row's minimum when k = V: keeps all
    nucleus = top_k_top_p_threshold(srt, k, p)  # [B, 1]
    threshold = torch.where((p < 1.0).unsqueeze(1), nucleus, kth)
    x.masked_fill_(x < threshold, NEG_INF)
    min_p_inplace(x, None, log_min_p)


def sample_exponential_race(rows: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(rows) without a host sync: ``argmax(p / E)`` with ``E``
    i.i.d. Exponential(1) draws from torch's default generator (the row whose ``E / p`` comes
    first wins, which happens with probability ``p``). Banned (-inf) tokens have ``p = 0`` and
    never win; ``E`` is kept off 0 so no ``0 / 0`` appears. rows: [R, V] float32; returns [R] long.
    """
    probs = rows.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
    return probs.div_(race).argmax(dim=-1)


def min_p_inplace(x: torch.Tensor, idx: torch.Tensor | None, log_min_p: torch.Tensor) -> None:
    """Ban tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    rows = take(x, idx)  # [R, V]
    cutoff = rows.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [R, 1]
    rows.masked_fill_(rows < cutoff, NEG_INF)
    put(x, idx, rows)


def sample_inverse_cdf(rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(rows), driven by one uniform per row.

    Inverse-CDF sampling on the unnormalised weights ``exp(x - max)``: the first token whose
    cumulative weight (float64) exceeds ``u * total``. Zero-weight (banned) tokens are
    never chosen; a row's result depends only on the row and its uniform, never on the
    rest of the batch. rows: [R, V] float32; uniforms: [R] float64 in [0, 1).
    Returns [R] long. On an AVX-512 CPU one C++ pass per row does it
    (``kernels/csrc/cpu_sampler.cpp``: its exp and the order of its sums are its own, so a
    token can differ from torch's route where two cumulative sums straddle ``u * total``).
    """
    kernel = vectorised_cpu_ops() if rows.is_cpu and rows.dtype == torch.float32 else None
    if kernel is not None and rows.stride(-1) == 1:
        return kernel.sample_rows(rows, uniforms)
    weights = (rows - rows.amax(dim=-1, keepdim=True)).exp_()  # [R, V], max weight 1
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    tok = torch.searchsorted(cdf, uniforms.unsqueeze(1) * total, right=True)  # [R, 1]
    last = torch.searchsorted(cdf, total)  # [R, 1] last token with positive weight
    return torch.minimum(tok, last).squeeze(1)  # guards u * total rounding up to total


def ban_tokens_soft(x: torch.Tensor, row_idx: torch.Tensor, rows: torch.Tensor, tok: torch.Tensor) -> None:
    """Set ``x[rows[i], tok[i]] = -inf``, except on rows where that would ban everything.

    row_idx: [M] unique affected rows; rows/tok: [N] ban pairs (rows within row_idx).
    """
    saved = x.index_select(0, row_idx)  # [M, V]
    x.index_put_((rows, tok), x.new_full((), NEG_INF))
    dead = x.index_select(0, row_idx).amax(dim=-1, keepdim=True) == NEG_INF  # [M, 1]
    x.index_copy_(0, row_idx, torch.where(dead, saved, x.index_select(0, row_idx)))
