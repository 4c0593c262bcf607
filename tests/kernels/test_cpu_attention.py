"""The C++ output-query attention (``kernels/csrc/cpu_attention.cpp``) the CPU torch path uses
for decode rows, drafts and forced runs: the same attention as the reference, and each token's
result the one it gets alone, whatever rows, other queries or threads share the call."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.cpu_fused import vectorised_cpu_ops
from kernels.paged_attention import PagedAttentionMetadata, paged_attention_reference, paged_attention_torch

BLOCK, HEADS, KV, DIM = 16, 9, 3, 64  # the default model's attention shape

pytestmark = pytest.mark.skipif(vectorised_cpu_ops() is None,
                                reason="the C++ output attention needs AVX-512 and a compiler")


def _caches(blocks: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(blocks, BLOCK, KV, DIM), torch.randn(blocks, BLOCK, KV, DIM)


def _meta(rows: list[tuple[list[int], int, int]], prompt_counts=None) -> PagedAttentionMetadata:
    meta = PagedAttentionMetadata.build([t for t, _, _ in rows], [q for _, q, _ in rows], [c for _, _, c in rows],
                                        BLOCK, torch.device("cpu"))
    return replace(meta, prompt_counts=prompt_counts)


def _tables(count: int, start: int) -> list[int]:
    return [(start + 7 * i) % 96 for i in range(count)]  # scattered blocks: read through the table


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_the_kernel_is_the_reference_attention(sliding_window) -> None:
    k, v = _caches()
    rows = [(_tables(20, 0), 1, 300), (_tables(4, 3), 5, 60), (_tables(13, 5), 1, 200), (_tables(8, 9), 70, 120)]
    query = torch.randn(77, HEADS, DIM)
    meta = _meta(rows)
    expected = paged_attention_reference(query, k, v, meta, scale=0.125, sliding_window=sliding_window)
    got = paged_attention_torch(query, k, v, meta, scale=0.125, sliding_window=sliding_window)
    assert torch.allclose(got, expected, atol=2e-6)
    counted = paged_attention_torch(query, k, v, replace(meta, prompt_counts=(0, 0, 0, 70)), scale=0.125,
                                    sliding_window=sliding_window)
    assert torch.allclose(counted, expected, atol=2e-6)


def test_a_token_gets_the_same_bits_decoded_alone_in_a_draft_or_beside_others() -> None:
    k, v = _caches()
    table = _tables(12, 2)
    query = torch.randn(6, HEADS, DIM)
    draft = paged_attention_torch(query, k, v, _meta([(table, 6, 180)]), scale=0.125)  # no prompt counts
    counted = paged_attention_torch(query, k, v, _meta([(table, 6, 180)], (0,)), scale=0.125)
    assert torch.equal(draft, counted)
    for j in range(6):
        lone = paged_attention_torch(query[j : j + 1], k, v, _meta([(table, 1, 175 + j)]), scale=0.125)
        assert torch.equal(lone[0], draft[j])
    others = torch.randn(3, HEADS, DIM)
    beside = paged_attention_torch(torch.cat([others[:2], query[5:], others[2:]]), k, v,
                                   _meta([(_tables(3, 40), 1, 33), (_tables(5, 50), 1, 77), (table, 1, 180),
                                          (_tables(20, 1), 1, 311)]), scale=0.125)
    assert torch.equal(beside[2], draft[5])


def test_threads_do_not_change_a_bit() -> None:
    k, v = _caches()
    rows = [(_tables(20, i), 1 + i % 3, 150 + 11 * i) for i in range(6)]
    query = torch.randn(sum(q for _, q, _ in rows), HEADS, DIM)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_torch(query, k, v, _meta(rows), scale=0.125)
        torch.set_num_threads(2)
        two = paged_attention_torch(query, k, v, _meta(rows), scale=0.125)
        few = paged_attention_torch(query[:1], k, v, _meta(rows[:1]), scale=0.125)  # one row: split by kv head
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(few[0], one[0])


def test_sinks_keep_the_sdpa_path() -> None:
    k, v = _caches()
    rows = [(_tables(4, 0), 1, 50), (_tables(4, 8), 2, 60)]
    query = torch.randn(3, HEADS, DIM)
    sinks = torch.randn(HEADS)
    meta = _meta(rows)
    expected = paged_attention_reference(query, k, v, meta, scale=0.125, sinks=sinks)
    assert torch.allclose(paged_attention_torch(query, k, v, meta, scale=0.125, sinks=sinks), expected, atol=1e-5)


def test_a_prompt_gets_the_same_bits_however_it_is_chunked() -> None:
    """With prompt counts every query, prompt or output, is the kernel's alone: a prompt of 70
    tokens (tiles of 16 queries and a partial one) whole, in chunks at block boundaries, and token
    by token give the same bits, close to the reference."""
    k, v = _caches()
    table = _tables(8, 4)
    query = torch.randn(70, HEADS, DIM)
    whole = paged_attention_torch(query, k, v, _meta([(table, 70, 70)], (70,)), scale=0.125)
    expected = paged_attention_reference(query, k, v, _meta([(table, 70, 70)]), scale=0.125)
    assert torch.allclose(whole, expected, atol=2e-6)
    first = paged_attention_torch(query[:32], k, v, _meta([(table, 32, 32)], (32,)), scale=0.125)
    rest = paged_attention_torch(query[32:], k, v, _meta([(table, 38, 70)], (30,)), scale=0.125)  # 30 + 8 outputs
    assert torch.equal(torch.cat([first, rest]), whole)
    for j in (0, 15, 16, 47, 69):
        lone = paged_attention_torch(query[j : j + 1], k, v, _meta([(table, 1, j + 1)], (1,)), scale=0.125)
        assert torch.equal(lone[0], whole[j])


def test_prompts_beside_outputs_keep_their_bits() -> None:
    """A step holding two prompt chunks, drafts and decode rows (the kernel's tasks sorted by
    cost, taken by whichever thread is free) gives each token what it gets alone."""
    k, v = _caches()
    rows = [(_tables(10, 1), 40, 150), (_tables(3, 2), 1, 33), (_tables(12, 3), 5, 180), (_tables(6, 5), 90, 90)]
    query = torch.randn(136, HEADS, DIM)
    step = paged_attention_torch(query, k, v, _meta(rows, (40, 0, 0, 90)), scale=0.125)
    starts = [0, 40, 41, 46]
    for (table, q_len, ctx), start in zip(rows, starts, strict=True):
        for j in (0, q_len - 1):
            lone = paged_attention_torch(query[start + j : start + j + 1], k, v, _meta([(table, 1, ctx - q_len + 1 + j)]),
                                         scale=0.125)
            assert torch.equal(lone[0], step[start + j])
