"""Bad words (token sequences never generated) and TensorRT-LLM's decaying top-p vs the reference."""

from __future__ import annotations

import pytest
import torch
from sampler_reference import (
    assert_logits_close,
    reference_bad_word_bans,
    reference_process,
    reference_top_p_schedule,
)

from sampler import Sampler, SamplingParams

V = 200
PROMPT = [11, 12, 13, 14]
OUTPUT = [20, 21, 22]

BAD_WORDS = {
    "single_token": SamplingParams(bad_words=((5,), (6,))),
    "phrase_at_output_end": SamplingParams(bad_words=((21, 22, 30),)),
    "phrase_not_matching": SamplingParams(bad_words=((21, 99, 30),)),
    "phrase_across_prompt_boundary": SamplingParams(bad_words=((13, 14, 20, 21, 22, 40),)),
    "phrase_longer_than_history": SamplingParams(bad_words=((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 41),)),
    "with_sampling": SamplingParams(temperature=0.7, top_k=30, bad_words=((22, 31), (32,))),
    "plain": SamplingParams(temperature=0.9),
}


def _rows(sampler: Sampler, params_list: list[SamplingParams]):
    rows = []
    for params in params_list:
        row = sampler.new_row(params, PROMPT)
        for t in OUTPUT:
            row.append_token(t)
        rows.append(row)
    return rows


def test_bans_are_what_the_reference_bans() -> None:
    assert reference_bad_word_bans(BAD_WORDS["phrase_at_output_end"].bad_words, PROMPT, OUTPUT) == [30]
    assert reference_bad_word_bans(BAD_WORDS["phrase_across_prompt_boundary"].bad_words, PROMPT, OUTPUT) == [40]
    assert reference_bad_word_bans(BAD_WORDS["phrase_not_matching"].bad_words, PROMPT, OUTPUT) == []
    sampler = Sampler(V, "cpu")
    rows = _rows(sampler, list(BAD_WORDS.values()))
    for row, params in zip(rows, BAD_WORDS.values()):
        assert sorted(row.banned_words_now()) == sorted(reference_bad_word_bans(params.bad_words, PROMPT, OUTPUT))


def test_bad_words_batch_matches_reference(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(V, device)
    params_list = list(BAD_WORDS.values())
    logits = torch.randn(len(params_list), V, generator=gen) * 3
    got = sampler.process_logits(logits.clone().to(device), _rows(sampler, params_list))
    for i, (name, params) in enumerate(BAD_WORDS.items()):
        assert_logits_close(got[i], reference_process(logits[i], params, PROMPT, OUTPUT)), name


def test_greedy_never_completes_a_banned_phrase(device: torch.device) -> None:
    """The argmax token is the phrase's last token: it must be passed over for the next best."""
    sampler = Sampler(V, device)
    params = SamplingParams(temperature=0.0, bad_words=((21, 22, 30),))
    row = _rows(sampler, [params])[0]
    logits = torch.zeros(1, V)
    logits[0, 30], logits[0, 31] = 10.0, 5.0
    assert sampler.sample(logits.clone().to(device), [row]).token_ids == [31]
    row.append_token(31)  # the phrase's head is gone: 30 is allowed again
    assert sampler.sample(logits.clone().to(device), [row]).token_ids == [30]


def test_bad_words_never_ban_every_token(device: torch.device) -> None:
    """A constraint allowing only the banned token wins (the ban is soft, like min_tokens')."""
    sampler = Sampler(V, device)
    row = _rows(sampler, [SamplingParams(temperature=0.0, bad_words=((7,),))])[0]
    logits = torch.full((1, V), float("-inf"))
    logits[0, 7] = 1.0
    assert sampler.sample(logits.to(device), [row]).token_ids == [7]


def test_decaying_top_p_follows_the_schedule_step_by_step(device: torch.device) -> None:
    """Two decaying rows (one with a reset id) and a fixed top-p row, several steps in one batch."""
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(V, device)
    params_list = [
        SamplingParams(temperature=1.0, top_p=0.95, top_p_decay=0.7, top_p_min=0.2),
        SamplingParams(temperature=0.8, top_p=0.9, top_p_decay=0.5, top_p_min=0.05, top_p_reset_ids=frozenset({9})),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, top_p_decay=0.8),  # starts at top_p 1.0 and decays
    ]
    tokens = [3, 9, 4, 4, 9, 5]
    schedules = [reference_top_p_schedule(p, tokens) for p in params_list]
    assert schedules[1][:3] == [0.9, 0.45, 0.9]  # the reset id brings the initial top-p back
    assert schedules[0][-1] == pytest.approx(0.2)  # floored at top_p_min
    rows = [sampler.new_row(p, PROMPT) for p in params_list]
    for step, tok in enumerate(tokens):
        logits = torch.randn(len(rows), V, generator=gen) * 2
        got = sampler.process_logits(logits.clone().to(device), rows)
        for i, params in enumerate(params_list):
            expected = reference_process(logits[i], params, PROMPT, tokens[:step], top_p=schedules[i][step])
            assert_logits_close(got[i], expected)
        for row in rows:
            row.append_token(tok)


def test_decaying_top_p_narrows_sampling_to_the_argmax(device: torch.device) -> None:
    """With a fast decay, a seeded row soon only draws the most likely token; without it, not."""
    sampler = Sampler(V, device)
    logits = torch.zeros(1, V)
    logits[0, 17] = 0.5  # most likely, but far from certain at top-p 1.0

    def draws(params: SamplingParams) -> list[int]:
        row = sampler.new_row(params, PROMPT)
        row.append_token(1)
        row.append_token(2)  # top-p is now 1e-4 for the decaying row
        out = []
        for _ in range(20):
            out.append(sampler.sample(logits.clone().to(device), [row]).token_ids[0])
            row.append_token(out[-1])
        return out

    assert draws(SamplingParams(temperature=1.0, top_p_decay=0.01, top_p_min=1e-6, seed=1)) == [17] * 20
    assert draws(SamplingParams(temperature=1.0, seed=1)) != [17] * 20


@pytest.mark.parametrize("kwargs", [{"top_p_decay": 0.0}, {"top_p_decay": 1.5}, {"top_p_min": 0.0},
                                    {"top_p_min": 2.0}, {"bad_words": ((),)}])
def test_params_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
