"""Attention of one engine step over a paged KV cache: every row's new tokens in one call.

The cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]`` (the
"NHD" paged layout of flash-attn and FlashInfer). A row (one sequence this step) owns the
blocks listed in its block-table row; its ``q_len`` new tokens are written into the cache
first (:func:`write_kv`), then attend causally over the row's whole context: query ``j`` of
row ``r`` sits at position ``context_lens[r] - q_len + j`` and sees keys ``0..`` that position
(or only the last ``sliding_window`` of them). Decode rows (``q_len == 1``), prefill chunks and
multi-token continuations mix freely in one call.

:func:`paged_attention_reference` is the oracle: plain torch, one row at a time, float32
softmax. The Triton kernel and the CPU fast path are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionMetadata:
    """Where one step's tokens go and what each row attends to (tensors on the cache's device).

    slot_mapping: [N] int64, flat cache slot ``block * block_size + offset`` of each new token.
    query_start: [R + 1] int32, row ``r``'s queries are ``query[query_start[r]:query_start[r + 1]]``.
    context_lens: [R] int32, tokens in row ``r``'s cache once this step's tokens are written.
    block_tables: [R, max_blocks] int32, row ``r``'s physical blocks in order (padding: any valid id).
    query_lens_host / context_lens_host: the same lengths as Python ints, for grids and CPU paths.
    """

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_host: list[int]
    context_lens_host: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host, default=0)

    @staticmethod
    def build(
        block_tables: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> "PagedAttentionMetadata":
        """From per-row block lists, new-token counts and context lengths (after this step)."""
        slots: list[int] = []
        for table, q_len, ctx in zip(block_tables, query_lens, context_lens, strict=True):
            for position in range(ctx - q_len, ctx):
                slots.append(table[position // block_size] * block_size + position % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return PagedAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), width),
            query_lens_host=list(query_lens),
            context_lens_host=list(context_lens),
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[N, kv_heads, head_dim]`` at their flat slots ``[N]``."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slot_mapping] = value.to(v_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [N, heads, head_dim] → [N, heads, head_dim], row by row in float32.

    ``sliding_window``: a query at position p sees keys ``p - sliding_window + 1 .. p``.
    ``sinks`` [heads]: one extra logit per head in the softmax denominator (gpt-oss).
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2).
    """
    heads = query.shape[1]
    kv_heads, head_dim = k_cache.shape[-2:]
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    for row in range(meta.num_rows):
        start = int(meta.query_start[row])
        q_len, ctx = meta.query_lens_host[row], meta.context_lens_host[row]
        if q_len == 0:
            continue
        blocks = meta.block_tables[row, : -(-ctx // block_size)].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()  # [ctx, kv, d]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].float()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, h, d]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        q = query[start : start + q_len].float()  # [q, h, d]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(-1, 1)
        k_pos = torch.arange(ctx, device=query.device).view(1, -1)
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(heads, 1, 1).expand(heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [N, heads, head_dim] → [N, heads, head_dim] (see the module docstring)."""
    return paged_attention_reference(
        query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, sinks=sinks, softcap=softcap
    )
