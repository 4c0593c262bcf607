"""Each processing step of the batched sampler vs the per-row reference."""

from __future__ import annotations

import pytest
import torch
from sampler_reference import assert_logits_close, reference_process, words_from_allowed

from sampler import Sampler, SamplingParams

V = 300

PARAMS = {
    "default": SamplingParams(),
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(temperature=0.9, top_k=7),
    "top_k_big": SamplingParams(top_k=V + 5),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
    "top_k_top_p": SamplingParams(top_k=20, top_p=0.5),
    "min_p": SamplingParams(temperature=0.7, min_p=0.05),
    "all_truncations": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
    "repetition": SamplingParams(repetition_penalty=1.4),
    "repetition_below_1": SamplingParams(repetition_penalty=0.7, temperature=0.5),
    "presence_frequency": SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
    "negative_penalties": SamplingParams(presence_penalty=-0.5, frequency_penalty=-0.2, temperature=0),
    "logit_bias": SamplingParams(logit_bias={3: 100.0, 5: -100.0, "7": 2.5}),
    "min_tokens": SamplingParams(min_tokens=5, banned_until_min_tokens=frozenset({0, 1, 2})),
    "min_tokens_done": SamplingParams(min_tokens=2, banned_until_min_tokens=frozenset({0})),
    "everything": SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, presence_penalty=0.2, frequency_penalty=0.1,
        repetition_penalty=1.1, logit_bias={9: 4.0}, min_tokens=10, banned_until_min_tokens=frozenset({2}),
    ),
}


def _history(gen: torch.Generator) -> tuple[list[int], list[int]]:
    prompt = torch.randint(0, V, (12,), generator=gen).tolist()
    output = torch.randint(0, 40, (6,), generator=gen).tolist() + [5, 5, 5]
    return prompt, output


def test_each_params_set_matches_reference_in_one_batch(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(V, device)
    names = list(PARAMS)
    logits = torch.randn(len(names), V, generator=gen) * 3
    rows, histories = [], []
    for name in names:
        prompt, output = _history(gen)
        row = sampler.new_row(PARAMS[name], prompt)
        for t in output:
            row.append_token(t)
        rows.append(row)
        histories.append((prompt, output))
    got = sampler.process_logits(logits.clone().to(device), rows)
    for i, name in enumerate(names):
        expected = reference_process(logits[i], PARAMS[name], *histories[i])
        assert_logits_close(got[i], expected), name


@pytest.mark.parametrize("name", list(PARAMS))
def test_single_row_matches_reference(device: torch.device, name: str) -> None:
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    sampler = Sampler(V, device)
    prompt, output = _history(gen)
    row = sampler.new_row(PARAMS[name], prompt)
    for t in output:
        row.append_token(t)
    logits = torch.randn(1, V, generator=gen) * 3
    expected = reference_process(logits[0], PARAMS[name], prompt, output)
    assert_logits_close(sampler.process_logits(logits.clone().to(device), [row])[0], expected)


def test_bitmask_only_touches_indexed_rows(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(), []) for _ in range(4)]
    logits = torch.randn(4, V, generator=gen)
    allowed = torch.rand(2, V, generator=gen) < 0.3
    indices = torch.tensor([3, 1])
    got = sampler.process_logits(logits.clone().to(device), rows, words_from_allowed(allowed).to(device), indices.to(device))
    for r, row in ((0, 3), (1, 1)):
        assert_logits_close(got[row], reference_process(logits[row], SamplingParams(), [], [], allowed[r]))
    assert torch.equal(got[0].cpu(), logits[0]) and torch.equal(got[2].cpu(), logits[2])


def test_bitmask_without_indices_and_padded_vocab(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(2)]
    logits = torch.randn(2, V + 20, generator=gen)  # padded model vocab
    allowed = torch.rand(2, V, generator=gen) < 0.1
    got = sampler.process_logits(logits.clone().to(device), rows, words_from_allowed(allowed).to(device))
    assert got.shape == (2, V)
    for r in range(2):
        assert_logits_close(got[r], reference_process(logits[r, :V], SamplingParams(), [], [], allowed[r]))
    result = sampler.sample(logits.clone().to(device), rows, words_from_allowed(allowed).to(device))
    for r in range(2):
        masked = logits[r, :V].masked_fill(~allowed[r], float("-inf"))
        assert result.token_ids[r] == int(masked.argmax())


def test_min_tokens_yields_to_constraints(device: torch.device) -> None:
    """If the ban would leave nothing (grammar only allows EOS), EOS stays allowed."""
    sampler = Sampler(V, device)
    row = sampler.new_row(SamplingParams(min_tokens=3, banned_until_min_tokens=frozenset({0})), [])
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, 0] = True
    logits = torch.randn(1, V)
    result = sampler.sample(logits.clone().to(device), [row], words_from_allowed(allowed).to(device))
    assert result.token_ids == [0]


def test_min_tokens_lifted_after_enough_tokens(device: torch.device) -> None:
    sampler = Sampler(V, device)
    row = sampler.new_row(SamplingParams(temperature=0, min_tokens=2, banned_until_min_tokens=frozenset({4})), [])
    logits = torch.zeros(1, V)
    logits[0, 4] = 10.0
    seen = []
    for _ in range(3):
        tok = sampler.sample(logits.clone().to(device), [row]).token_ids[0]
        seen.append(tok)
        row.append_token(tok)
    assert seen[0] != 4 and seen[1] != 4 and seen[2] == 4


def test_penalties_track_appended_and_forced_tokens(device: torch.device) -> None:
    """Counts update incrementally across passes (sampled and forced tokens alike)."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    sampler = Sampler(V, device)
    prompt = [1, 2, 3]
    rows = [sampler.new_row(params, prompt), sampler.new_row(SamplingParams(temperature=0), [])]
    output: list[int] = []
    for step in range(6):
        logits = torch.randn(2, V, generator=gen)
        got = sampler.process_logits(logits.clone().to(device), rows)
        assert_logits_close(got[0], reference_process(logits[0], params, prompt, output))
        assert_logits_close(got[1], logits[1])
        tok = sampler.sample(logits.clone().to(device), rows).token_ids[0]
        for t in (tok, 7) if step % 2 else (tok,):  # every other step, a forced token too
            rows[0].append_token(t)
            output.append(t)
        rows[1].append_token(0)


def test_penalty_slots_are_recycled(device: torch.device) -> None:
    sampler = Sampler(V, device)
    params = SamplingParams(frequency_penalty=1.0)
    for _ in range(20):
        row = sampler.new_row(params, [1])
        row.append_token(2)
        sampler.sample(torch.randn(1, V).to(device), [row])
        row.release()
    assert sampler._pool.counts.shape[0] == 8
    fresh = sampler.new_row(SamplingParams(temperature=0, frequency_penalty=1.0), [])
    logits = torch.zeros(1, V)
    assert_logits_close(sampler.process_logits(logits.clone().to(device), [fresh])[0], logits[0])


def test_bf16_logits(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    sampler = Sampler(V, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), []), sampler.new_row(SamplingParams(top_k=3), [])]
    logits = (torch.randn(2, V, generator=gen) * 3).bfloat16()
    result = sampler.sample(logits.clone().to(device), rows)
    assert result.token_ids[0] == int(logits[0].float().argmax())
    assert result.token_ids[1] in logits[1].float().topk(3).indices.tolist()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"repetition_penalty": 0.0},
        {"top_logprobs": 21}, {"min_tokens": -1}, {"logit_bias": {1: 101.0}},
    ],
)
def test_params_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_normalisation() -> None:
    p = SamplingParams(logit_bias={"5": 1}, banned_until_min_tokens={2})
    assert dict(p.logit_bias) == {5: 1.0} and p.banned_until_min_tokens == frozenset({2})
    assert SamplingParams(temperature=0).greedy and not SamplingParams().has_penalties
