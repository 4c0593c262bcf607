"""Sampling behaviour: greedy, masks, seeds, distribution, logprobs."""

from __future__ import annotations

import math

import torch
from sampler_reference import log_softmax, reference_process, words_from_allowed

from sampler import LOGPROB_FLOOR, Sampler, SamplingParams

V = 257


def test_greedy_is_argmax(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(9)]
    for _ in range(3):
        logits = torch.randn(9, V, generator=gen)
        assert sampler.sample(logits.clone().to(device), rows).token_ids == logits.argmax(-1).tolist()


def test_greedy_mixed_with_random_rows(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0 if i % 2 else 1.0, seed=i), []) for i in range(6)]
    logits = torch.randn(6, V, generator=gen)
    ids = sampler.sample(logits.clone().to(device), rows).token_ids
    assert [ids[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(-1).tolist()


def test_masks_respected_over_many_seeds(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    n = 64
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=3.0, seed=s), []) for s in range(n)]
    allowed = torch.rand(n, V, generator=gen) < 0.05
    allowed[:, 0] = True
    words = words_from_allowed(allowed).to(device)
    for _ in range(5):
        logits = torch.randn(n, V, generator=gen) * 4
        logits[:, 1] = 50.0  # a very likely banned token
        ids = sampler.sample(logits.clone().to(device), rows, words).token_ids
        assert all(allowed[r, t] for r, t in enumerate(ids))


def test_top_k_and_top_p_respected(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 48
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(seed=s, top_k=3 if s % 2 else -1, top_p=1.0 if s % 2 else 0.3), []) for s in range(n)]
    logits = torch.randn(n, V, generator=gen) * 2
    ids = sampler.sample(logits.clone().to(device), rows).token_ids
    for r, t in enumerate(ids):
        expected = reference_process(logits[r], rows[r].params, [], [])
        assert expected[t] > float("-inf")


def _sequence(device: torch.device, position: int, batch: int, others: list[SamplingParams], steps: int = 4) -> list[int]:
    """Tokens a seed-42 row gets at ``position`` in a batch of other rows."""
    gen = torch.Generator().manual_seed(99)
    base = torch.randn(steps, V, generator=gen) * 2
    sampler = Sampler(V, device)
    target = sampler.new_row(SamplingParams(seed=42, top_p=0.9, temperature=0.8), [])
    rows = [sampler.new_row(p, [1, 2]) for p in others[: batch - 1]]
    rows.insert(position, target)
    out = []
    for step in range(steps):
        logits = torch.randn(batch, V) * 5  # other rows: arbitrary
        logits[position] = base[step]
        allowed = torch.ones(1, V, dtype=torch.bool)
        ids = sampler.sample(logits.clone().to(device), rows, words_from_allowed(allowed).to(device), torch.tensor([position]).to(device)).token_ids
        out.append(ids[position])
        for row, tok in zip(rows, ids):
            row.append_token(tok)
    return out


def test_seed_determinism_independent_of_batch(device: torch.device) -> None:
    others = [
        SamplingParams(temperature=0),
        SamplingParams(seed=1, top_k=5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(seed=None, min_p=0.2, logprobs=True, top_logprobs=2),
        SamplingParams(repetition_penalty=1.2, temperature=2.0),
    ]
    alone = _sequence(device, 0, 1, others)
    assert _sequence(device, 0, 1, others) == alone
    assert _sequence(device, 2, 4, others) == alone
    assert _sequence(device, 5, 6, others) == alone
    assert _sequence(device, 1, 3, others[::-1]) == alone


def test_different_seeds_differ(device: torch.device) -> None:
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(seed=s), []) for s in range(32)]
    ids = sampler.sample(torch.zeros(32, V).to(device), rows).token_ids
    assert len(set(ids)) > 20


def test_empirical_distribution_matches_softmax(device: torch.device) -> None:
    """Inverse-CDF sampling draws from softmax(logits / T)."""
    vocab = 6
    sampler = Sampler(vocab, device)
    n = 4000
    rows = [sampler.new_row(SamplingParams(seed=s, temperature=0.7), []) for s in range(n)]
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, float("-inf"), 2.0])
    ids = sampler.sample(logits.expand(n, vocab).clone().to(device), rows).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=vocab).double() / n
    probs = torch.softmax(logits.double() / 0.7, 0)
    assert freq[4] == 0
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n)


def test_logprobs_are_of_processed_distribution(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(V, device)
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5, presence_penalty=1.0),
        SamplingParams(seed=3, temperature=0.5, top_k=4, logprobs=True, top_logprobs=6),
        SamplingParams(seed=4),  # no logprobs
        SamplingParams(seed=5, top_p=0.7, logprobs=True),
    ]
    rows = [sampler.new_row(p, []) for p in params]
    for row in rows:
        row.append_token(11)
    logits = torch.randn(4, V, generator=gen) * 2
    logits[0, 11] = 100.0
    result = sampler.sample(logits.clone().to(device), rows)
    assert result.logprobs[2] is None
    for r in (0, 1, 3):
        lp = result.logprobs[r]
        expected = log_softmax(reference_process(logits[r], params[r], [], [11]))
        assert lp.token_id == result.token_ids[r]
        assert math.isclose(lp.logprob, float(expected[lp.token_id]), abs_tol=1e-4)
        assert len(lp.top) == params[r].top_logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for tok, val in lp.top:
            want = max(float(expected[tok]), LOGPROB_FLOOR)
            assert math.isclose(val, want, abs_tol=1e-4)
    assert result.logprobs[0].token_id == 11  # greedy: still the argmax after the penalty


def test_choice_index_gives_distinct_reproducible_streams(device: torch.device) -> None:
    def run(choice: int) -> list[int]:
        sampler = Sampler(V, device)
        row = sampler.new_row(SamplingParams(seed=7), [], choice_index=choice)
        return [sampler.sample(torch.zeros(1, V).to(device), [row]).token_ids[0] for _ in range(5)]

    assert run(0) == run(0) and run(1) == run(1)
    assert run(0) != run(1)


def test_list_bitmask_indices_and_cpu_bitmask(device: torch.device) -> None:
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(3)]
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, 9] = True
    ids = sampler.sample(torch.randn(3, V).to(device), rows, words_from_allowed(allowed), [2]).token_ids
    assert ids[2] == 9
