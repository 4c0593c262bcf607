"""The torch path's token-by-token mode (``prompt_counts``, used with quantized weights): the
same attention as the batched path, and an output token's result bit-identical to the one it
gets as a lone decode row, whatever row or batch it comes in."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.paged_attention import PagedAttentionMetadata, paged_attention_torch

BLOCK, HEADS, KV, DIM = 4, 4, 2, 16


def _caches(blocks: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(blocks, BLOCK, KV, DIM), torch.randn(blocks, BLOCK, KV, DIM)


def _meta(rows: list[tuple[list[int], int, int]], prompt_counts=None) -> PagedAttentionMetadata:
    meta = PagedAttentionMetadata.build([t for t, _, _ in rows], [q for _, q, _ in rows], [c for _, _, c in rows],
                                        BLOCK, torch.device("cpu"))
    return replace(meta, prompt_counts=prompt_counts)


def test_token_by_token_is_the_same_attention() -> None:
    k, v = _caches()
    rows = [([1, 2, 3], 5, 11), ([4, 5], 1, 7), ([6, 7, 8], 9, 9)]  # draft row, decode row, prefill chunk
    query = torch.randn(15, HEADS, DIM)
    batched = paged_attention_torch(query, k, v, _meta(rows), scale=0.25)
    alone = paged_attention_torch(query, k, v, _meta(rows, (0, 0, 9)), scale=0.25)
    assert torch.allclose(alone, batched, atol=1e-5)
    mixed = paged_attention_torch(query[:5], k, v, _meta(rows[:1], (2,)), scale=0.25)  # 2 prompt + 3 output
    assert torch.allclose(mixed, batched[:5], atol=1e-5)


def test_an_output_token_gets_what_it_gets_as_a_lone_decode_row() -> None:
    k, v = _caches()
    query = torch.randn(5, HEADS, DIM)
    in_a_row = paged_attention_torch(query, k, v, _meta([([1, 2, 3], 5, 11)], (0,)), scale=0.25)
    for j in range(5):  # the row's token j alone, its context ending at its own position
        lone = paged_attention_torch(query[j : j + 1], k, v, _meta([([1, 2, 3], 1, 7 + j)], (0,)), scale=0.25)
        assert torch.equal(lone[0], in_a_row[j])
    beside = paged_attention_torch(torch.cat([torch.randn(1, HEADS, DIM), query[4:]]), k, v,
                                   _meta([([4, 5], 1, 6), ([1, 2, 3], 1, 11)], (0, 0)), scale=0.25)
    assert torch.equal(beside[1], in_a_row[4])  # next to another decode row of another length


@pytest.mark.parametrize("contexts,drafts", [
    ([700, 33, 16, 257, 1, 512, 95], [1, 4, 1, 2, 1, 1, 3]),  # lengths far apart: read row by row
    ([300, 291, 317, 305, 288, 310], [1, 1, 3, 1, 2, 1]),  # alike: gathered together, padded
    ([300, 291, 317, 305, 288, 310], [3, 3, 3, 3, 2, 3]),  # drafts together too, one row's third repeated
])
def test_lone_and_batched_agree_bit_for_bit_at_real_shapes(contexts: list[int], drafts: list[int]) -> None:
    """The output queries of a step share SDPA calls, padded to whole blocks (to the longest
    context's when rows are gathered together) and masked: at the default model's attention
    shape (9 query heads over 3, head dim 64, blocks of 16) and contexts up to ~700 keys, every
    token's result is still the one it gets alone, with and without a sliding window."""
    block, heads, kv, dim = 16, 9, 3, 64
    generator = torch.Generator().manual_seed(7)
    k = torch.randn(200, block, kv, dim, generator=generator)
    v = torch.randn(200, block, kv, dim, generator=generator)
    order = torch.randperm(199, generator=generator).add(1).tolist()
    rows, start = [], 0
    for ctx in contexts:
        width = -(-ctx // block)
        rows.append((order[start : start + width], ctx))
        start += width
    query = torch.randn(sum(drafts), heads, dim, generator=generator)
    for window in (None, 40):
        step = _shaped_meta([(t, n, c) for (t, c), n in zip(rows, drafts)], block, (0,) * len(rows))
        together = paged_attention_torch(query, k, v, step, scale=0.125, sliding_window=window)
        token = 0
        for (table, ctx), n in zip(rows, drafts):
            for j in range(n):
                lone_meta = _shaped_meta([(table, 1, ctx - n + 1 + j)], block, (0,))
                lone = paged_attention_torch(query[token : token + 1], k, v, lone_meta, scale=0.125,
                                             sliding_window=window)
                assert torch.equal(lone[0], together[token]), (window, ctx, j)
                token += 1


def _shaped_meta(rows: list[tuple[list[int], int, int]], block: int, prompt_counts) -> PagedAttentionMetadata:
    meta = PagedAttentionMetadata.build([t for t, _, _ in rows], [q for _, q, _ in rows], [c for _, _, c in rows],
                                        block, torch.device("cpu"))
    return replace(meta, prompt_counts=prompt_counts)


@pytest.mark.parametrize("extra", [{"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}, {"softcap": 5.0}])
def test_sinks_and_softcaps_keep_each_output_query_alone(extra: dict) -> None:
    """A sink's extra key or a softcap's float path is not padded: each output query keeps a call
    of its own over exactly its keys, the same attention as the batched path's."""
    k, v = _caches()
    rows = [([1, 2, 3], 3, 11), ([4, 5], 1, 7)]  # a draft row and a decode row
    query = torch.randn(4, HEADS, DIM)
    alone = paged_attention_torch(query, k, v, _meta(rows, (0, 0)), scale=0.25, **extra)
    batched = paged_attention_torch(query, k, v, _meta(rows), scale=0.25, **extra)
    assert torch.allclose(alone, batched, atol=1e-5)
    lone = paged_attention_torch(query[3:], k, v, _meta([([4, 5], 1, 7)], (0,)), scale=0.25, **extra)
    assert torch.equal(lone[0], alone[3])
