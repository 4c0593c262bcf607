"""The static (graph-capturable) sampling pass against the eager sampler: greedy rows give the same
tokens and logprobs, sampled rows draw from the same processed distribution, and the rows it
cannot take send the whole step back to the eager sampler."""

from __future__ import annotations

import pytest
import torch
from sampler_reference import TokenDFASpec, words_from_allowed

from sampler import Sampler, SamplingParams
from sampler.graphable import VARIANTS, StaticSampler, Variant, row_qualifies

V = 300
PROMPT = [5, 6]


def allowed_words(device, *spans: tuple[int, int]) -> torch.Tensor:
    """[len(spans), W] bitmask allowing tokens lo..hi-1 per row."""
    allowed = torch.zeros(len(spans), V, dtype=torch.bool)
    for row, (lo, hi) in enumerate(spans):
        allowed[row, lo:hi] = True
    return words_from_allowed(allowed).to(device)


def static_sample(static: StaticSampler, logits, rows, bucket, bitmask=None, indices=None):
    variant = static.prepare(logits, rows, bucket, bitmask, indices)
    assert variant is not None
    static.run(bucket, variant)
    return static.read(rows, variant), variant


GREEDY = [
    SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, logprobs=True),  # chosen only
    SamplingParams(temperature=0, top_k=3, top_p=0.5, logprobs=True, top_logprobs=20),  # truncation ignored when greedy
]
RANDOM = [
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.0),
]


@pytest.mark.parametrize("with_random", [False, True])
def test_greedy_rows_give_the_eager_tokens_and_logprobs_with_masks(device, with_random):
    gen = torch.Generator().manual_seed(7)
    sampler, static = Sampler(V, device), StaticSampler(V, 16, device)
    params = GREEDY + (RANDOM if with_random else [])
    rows = [sampler.new_row(p, PROMPT) for p in params]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    for step in range(4):
        logits = (torch.randn(len(rows), V, generator=gen) * 3).to(device)
        bitmask = allowed_words(device, (40, 60), (0, 7 + step))  # rows 0 and 3 constrained (3: to 7+ tokens)
        indices = torch.tensor([0, 3], device=device)
        eager = sampler.sample(logits.clone(), rows, bitmask, indices)
        got, variant = static_sample(static, logits.clone(), rows, 16, bitmask, indices)
        assert variant == Variant(random=with_random, truncate=with_random, logprobs=True)
        assert [got.token_ids[i] for i in greedy] == [eager.token_ids[i] for i in greedy]
        assert [got.logprobs[i] for i in greedy] == [eager.logprobs[i] for i in greedy]
        assert 40 <= got.token_ids[0] < 60 and got.token_ids[3] < 7 + step
        assert got.logprobs[1] is None and len(got.logprobs[0].top) == 5 and got.logprobs[2].top == []
        assert got.failures == {}


def test_plain_greedy_without_logprobs_reads_the_ids_only(device):
    sampler, static = Sampler(V, device), StaticSampler(V, 4, device)
    rows = [sampler.new_row(SamplingParams(temperature=0), PROMPT) for _ in range(3)]
    logits = torch.randn(3, V, device=device)
    got, variant = static_sample(static, logits.clone(), rows, 4)
    assert variant == Variant(False, False, False)
    assert got.token_ids == logits.argmax(dim=-1).tolist() == sampler.sample(logits.clone(), rows).token_ids
    assert got.logprobs == [None, None, None]


def test_sampled_rows_draw_from_the_eager_processed_distribution(device):
    gen = torch.Generator().manual_seed(3)
    sampler, static = Sampler(V, device), StaticSampler(V, 16, device)
    params = RANDOM + GREEDY
    rows = [sampler.new_row(p, PROMPT) for p in params]
    for _ in range(5):
        logits = (torch.randn(len(rows), V, generator=gen) * 4).to(device)
        bitmask = allowed_words(device, (10, 200), (0, 150))
        indices = torch.tensor([1, 2], device=device)
        expected = sampler.process_logits(logits.clone(), rows, bitmask, indices)
        got, _ = static_sample(static, logits.clone(), rows, 16, bitmask, indices)
        processed = static.logits[: len(rows)]  # the pass processes the logits in place
        assert torch.equal(torch.isneginf(processed), torch.isneginf(expected))
        assert torch.equal(processed.softmax(dim=-1), expected.softmax(dim=-1))
        for i, token in enumerate(got.token_ids):  # always inside the mask / top-k / top-p / min-p set
            assert expected[i, token] > float("-inf"), (i, token)
        chosen = expected[1].log_softmax(dim=-1)[got.token_ids[1]].item()
        assert got.logprobs[1].logprob == pytest.approx(chosen, abs=1e-6)


def test_draws_are_deterministic_under_a_torch_seed_and_differ_between_runs():
    sampler, static = Sampler(V, "cpu"), StaticSampler(V, 8, "cpu")
    rows = [sampler.new_row(SamplingParams(temperature=1.0), PROMPT) for _ in range(8)]
    logits = torch.zeros(8, V)  # uniform over 300 tokens
    torch.manual_seed(11)
    first = static_sample(static, logits.clone(), rows, 8)[0].token_ids
    second = static_sample(static, logits.clone(), rows, 8)[0].token_ids
    torch.manual_seed(11)
    again = static_sample(static, logits.clone(), rows, 8)[0].token_ids
    assert first == again and first != second


def test_draw_frequencies_follow_the_probabilities():
    rows_count = 4096
    sampler, static = Sampler(V, "cpu"), StaticSampler(V, rows_count, "cpu")
    rows = [sampler.new_row(SamplingParams(temperature=1.0, top_k=2), PROMPT)] * rows_count
    logits = torch.full((rows_count, V), -5.0)
    logits[:, 7], logits[:, 9] = torch.log(torch.tensor(3.0)), 0.0  # after top-k: p(7) = 0.75, p(9) = 0.25
    torch.manual_seed(0)
    tokens = torch.tensor(static_sample(static, logits, rows, rows_count)[0].token_ids)
    assert set(tokens.tolist()) <= {7, 9}
    assert 0.70 < (tokens == 7).float().mean().item() < 0.80  # 7 standard deviations each side


def test_padding_rows_of_the_bucket_are_harmless(device):
    sampler, static = Sampler(V, device), StaticSampler(V, 8, device)
    rows = [sampler.new_row(p, PROMPT) for p in GREEDY[:2]]
    static.logits.fill_(float("nan"))  # stale rows past the batch
    logits = torch.randn(2, V, device=device)
    bitmask, indices = allowed_words(device, (3, 9)), torch.tensor([1], device=device)
    got, _ = static_sample(static, logits.clone(), rows, 8, bitmask, indices)
    assert got.token_ids == sampler.sample(logits.clone(), rows, bitmask, indices).token_ids


def _choice_dfa() -> TokenDFASpec:
    return TokenDFASpec.from_edges(2, V, {0: {1: 1}}, final={1}, stops=[0])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(temperature=0, presence_penalty=0.5),
    SamplingParams(temperature=0, logit_bias={5: 3.0}),
    SamplingParams(temperature=0, bad_words=((4, 5),)),
    SamplingParams(temperature=0.8, top_p=0.9, top_p_decay=0.5),
    SamplingParams(temperature=0, custom_processor=lambda logits, params: logits),
], ids=["seed", "repetition", "presence", "logit_bias", "bad_words", "decaying_top_p", "custom"])
def test_a_row_the_pass_cannot_take_sends_the_step_to_the_eager_sampler(params):
    sampler, static = Sampler(V, "cpu"), StaticSampler(V, 4, "cpu")
    rows = [sampler.new_row(SamplingParams(temperature=0), PROMPT), sampler.new_row(params, PROMPT)]
    assert not row_qualifies(rows[1])
    assert static.prepare(torch.randn(2, V), rows, 2) is None
    assert static.prepare(torch.randn(1, V), rows[:1], 2) is not None  # the qualifying row alone


def test_min_tokens_and_device_dfa_rows_qualify_only_while_nothing_dynamic_applies():
    sampler, static = Sampler(V, "cpu"), StaticSampler(V, 4, "cpu")
    free = sampler.new_row(SamplingParams(temperature=0), PROMPT)
    short = sampler.new_row(SamplingParams(temperature=0, min_tokens=2, banned_until_min_tokens=frozenset({0})), PROMPT)
    assert static.prepare(torch.randn(2, V), [free, short], 2) is None
    short.append_token(3)
    short.append_token(4)
    assert static.prepare(torch.randn(2, V), [free, short], 2) is not None  # min_tokens reached
    free.attach_dfa(_choice_dfa())
    assert static.prepare(torch.randn(2, V), [free, short], 2) is None  # the row changed: checked again
    free.detach_dfa()
    assert static.prepare(torch.randn(2, V), [free, short], 2) is not None


def test_shapes_the_pass_cannot_take_are_declined():
    sampler, static = Sampler(V, "cpu"), StaticSampler(V, 4, "cpu")
    rows = [sampler.new_row(SamplingParams(temperature=0), PROMPT) for _ in range(3)]
    assert static.prepare(torch.randn(3, V), rows, 2) is None  # more rows than the bucket
    assert static.prepare(torch.randn(3, V - 1), rows, 4) is None  # narrower logits
    narrow = torch.zeros(1, 3, dtype=torch.int32)  # a bitmask of another width
    assert static.prepare(torch.randn(3, V), rows, 4, narrow, torch.tensor([0])) is None
    assert static.prepare(torch.randn(3, V + 20), rows, 4) is not None  # a padded model vocab is cut


def test_every_variant_runs_on_any_rows(device):
    sampler, static = Sampler(V, device), StaticSampler(V, 4, device)
    rows = [sampler.new_row(p, PROMPT) for p in GREEDY[:2] + RANDOM[:2]]
    for variant in VARIANTS:  # what a capture runs, whatever the buffers hold
        static.prepare(torch.randn(4, V, device=device), rows, 4)
        static.run(4, variant)
        assert 0 <= int(static.ids[:4].min()) and int(static.ids[:4].max()) < V
