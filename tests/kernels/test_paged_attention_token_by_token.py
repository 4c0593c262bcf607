"""The torch path's token-by-token mode (``prompt_counts``, used with quantized weights): the
same attention as the batched path, and an output token's result bit-identical to the one it
gets as a lone decode row, whatever row or batch it comes in."""

from __future__ import annotations

from dataclasses import replace

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
