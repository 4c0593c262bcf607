"""Choice scoring: every choice's whole-sequence probability from one batched pass."""

from __future__ import annotations

import math

import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest

PROMPT = [1, 504, 3300, 28, 1012, 77]
CHOICES = ["positive", "negative", "neutral sentiment", "mixed feelings overall", "unknown"]


@pytest.fixture(scope="module")
def parts(tiny_model_dir, default_tokenizer):
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    compiler = ConstraintCompiler(default_tokenizer, hf.config.vocab_size, stop_token_ids=[2])
    yield hf, default_tokenizer, compiler
    compiler.close()


def reference_score(hf, prompt: list[int], choice: list[int]) -> float:
    """Sum of the choice's token logprobs after the prompt, by transformers' own forward."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt + choice])).logits[0].log_softmax(dim=-1)
    return sum(float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(choice))


def score(parts, choices, *, slots=8, temperature=0.0, seed=None, top_logprobs=0, neighbours=()):
    hf, tokenizer, compiler = parts
    engine = Engine(ModelRunner.for_sequences(hf, slots, 256), tokenizer, max_batch_size=slots,
                    max_model_len=256)
    results: dict[str, dict] = {}

    def sink_for(name):
        results[name] = {"tokens": [], "logprobs": [], "last": None}

        def sink(delta):
            results[name]["tokens"] += delta.token_ids
            results[name]["logprobs"] += delta.logprobs or []
            results[name]["last"] = delta
        return sink

    params = SamplingParams(temperature=temperature, seed=seed, logprobs=True, top_logprobs=top_logprobs)
    matcher = compiler.compile(ConstraintSpec("choice", choices)).new_matcher()
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in choices]
    engine.submit(GenerationRequest("scored", PROMPT, params, 20, sink_for("scored"), matcher=matcher,
                                    score_choices=ids, eos_token_ids=frozenset({2})))
    for i, prompt in enumerate(neighbours):
        engine.submit(GenerationRequest(f"n{i}", prompt, SamplingParams(temperature=0.0), 12, sink_for(f"n{i}")))
    for _ in range(200):
        if all(r["last"] is not None and r["last"].finish_reason for r in results.values()):
            return engine, ids, results
        engine.step()
    raise AssertionError("engine did not finish")


def test_probabilities_are_whole_sequence_and_normalised(parts):
    hf = parts[0]
    engine, ids, results = score(parts, CHOICES, top_logprobs=2)
    scored = results["scored"]
    delta = scored["last"]
    assert delta.finish_reason == "stop" and engine.stats.failed_sequences == 0
    normalised = delta.choice_logprobs
    assert sum(math.exp(v) for v in normalised) == pytest.approx(1.0, abs=1e-6)
    raw = [reference_score(hf, PROMPT, choice) for choice in ids]
    shift = normalised[0] - raw[0]  # normalising subtracts one constant from every raw score
    assert [v - shift for v in normalised] == pytest.approx(raw, abs=1e-3)
    best = max(range(len(CHOICES)), key=raw.__getitem__)
    assert scored["tokens"] == ids[best]  # temperature 0: the most probable whole choice
    assert sum(lp.logprob for lp in scored["logprobs"]) == pytest.approx(raw[best], abs=1e-3)  # raw, unnormalised
    assert all(len(lp.top) == 2 for lp in scored["logprobs"])
    assert engine.stats.scored_choices == len(CHOICES)
    assert engine.stats.steps == 2  # the prompt, then every choice in one batched pass


def test_argmax_is_by_whole_sequence_not_first_token(parts):
    """Pick, from candidates, two choices where the first-token ranking and the whole-sequence
    ranking disagree; the engine must answer by the whole sequence."""
    hf, tokenizer, _ = parts
    candidates = ["yes", "no", "maybe", "yes indeed", "no way at all", "perhaps", "never ever again", "sure thing"]
    ids = {c: tokenizer.encode(c, add_special_tokens=False) for c in candidates}
    whole = {c: reference_score(hf, PROMPT, ids[c]) for c in candidates}
    first = {c: reference_score(hf, PROMPT, ids[c][:1]) for c in candidates}
    pairs = [(a, b) for a in candidates for b in candidates
             if a != b and first[a] > first[b] and whole[a] < whole[b] and not b.startswith(a) and not a.startswith(b)]
    assert pairs, "no disagreeing pair among the candidates"
    a, b = pairs[0]
    _, _, results = score(parts, [a, b])
    assert results["scored"]["tokens"] == ids[b]


def test_more_choices_than_free_slots_and_neighbours_unchanged(parts):
    hf, tokenizer, _ = parts
    _, _, wide = score(parts, CHOICES)
    neighbours = [[1, 9, 10, 11], [1, 300, 301, 302, 303]]
    engine, _, narrow = score(parts, CHOICES, slots=3, neighbours=neighbours)
    assert narrow["scored"]["last"].choice_logprobs == pytest.approx(wide["scored"]["last"].choice_logprobs, abs=1e-4)
    assert narrow["scored"]["tokens"] == wide["scored"]["tokens"]
    for i, prompt in enumerate(neighbours):
        alone = Engine(ModelRunner.for_sequences(hf, 1, 256), tokenizer, max_batch_size=1, max_model_len=256)
        got = []
        alone.submit(GenerationRequest("a", prompt, SamplingParams(temperature=0.0), 12,
                                       lambda d: got.append(d)))
        while not (got and got[-1].finish_reason):
            alone.step()
        assert narrow[f"n{i}"]["tokens"] == [t for d in got for t in d.token_ids]


def test_sampling_draws_from_the_choice_distribution_reproducibly(parts):
    picks = [tuple(score(parts, CHOICES, temperature=1.0, seed=s)[2]["scored"]["tokens"]) for s in (5, 5, 6)]
    assert picks[0] == picks[1]
    assert all(list(p) in [score_ids for score_ids in score(parts, CHOICES)[1]] for p in picks)
