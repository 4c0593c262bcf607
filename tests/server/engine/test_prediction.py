"""Predicted outputs in the engine: drafts verified in the batched step, output unchanged."""

from __future__ import annotations

import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest
from tests.server.engine.paged_util import extend, step

PROMPTS = [[1, 504, 3300, 28, 1012], [1, 77, 88, 99], [1, 2500, 314, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def make_engine(hf, tokenizer, slots: int = 8, **kwargs) -> Engine:
    runner = ModelRunner.for_sequences(hf, slots, 512)
    return Engine(runner, tokenizer, max_batch_size=slots, max_model_len=512, **{"speculation": False, **kwargs})


def run(engine: Engine, requests: list[dict]) -> list[dict]:
    """Submit all requests at once, step until all finish; per request: tokens, logprobs, last delta."""
    results = [{"tokens": [], "logprobs": [], "last": None} for _ in requests]

    def sink_for(i):
        def sink(delta):
            results[i]["tokens"] += delta.token_ids
            results[i]["logprobs"] += [lp.logprob for lp in delta.logprobs or ()]
            results[i]["last"] = delta
        return sink

    for i, fields in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", sink=sink_for(i), **fields))
    for _ in range(2000):
        if all(r["last"] is not None and r["last"].finish_reason for r in results):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


def request(prompt, max_tokens=24, temperature=0.0, seed=None, **extra) -> dict:
    """Greedy by default; the presence penalty keeps the random tiny model from repeating one
    token forever (and makes every position depend on the tokens before it)."""
    params = SamplingParams(temperature=temperature, seed=seed, logprobs=True, presence_penalty=2.0)
    return {"prompt_token_ids": prompt, "params": params, "max_tokens": max_tokens, **extra}


def test_runner_returns_per_position_logits(tiny_hf):
    runner = ModelRunner.for_sequences(tiny_hf, 3, 64)
    a, b = [5, 17, 300, 42, 7, 9], [11, 12, 13]
    extend(runner, 0, a[:3], 0)
    extend(runner, 1, b[:2], 0)
    rows = [(1, b[2:], 2), (0, a[3:], 3)]  # a decode row and an extension asking for all 3 positions
    logits = step(runner, rows, logit_counts=[1, 3])
    with torch.no_grad():
        ref_a, ref_b = tiny_hf(torch.tensor([a])).logits[0], tiny_hf(torch.tensor([b])).logits[0]
    assert logits.shape[0] == 4
    torch.testing.assert_close(logits[0], ref_b[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:], ref_a[3:], atol=1e-4, rtol=1e-4)


def test_correct_prediction_same_output_in_fewer_steps(tiny_hf, default_tokenizer):
    plain_engine = make_engine(tiny_hf, default_tokenizer)
    plain = run(plain_engine, [request(PROMPTS[0])])[0]
    engine = make_engine(tiny_hf, default_tokenizer)
    predicted = run(engine, [request(PROMPTS[0], prediction_token_ids=plain["tokens"])])[0]
    assert predicted["tokens"] == plain["tokens"]
    assert predicted["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-4)
    # every step emits one token sampled after its draft; all the others are accepted draft tokens
    assert predicted["last"].accepted_prediction_tokens == len(plain["tokens"]) - engine.stats.steps
    assert predicted["last"].rejected_prediction_tokens == 0
    assert engine.stats.accepted_draft_tokens == len(plain["tokens"]) - engine.stats.steps
    assert engine.stats.steps <= 3 < plain_engine.stats.steps == len(plain["tokens"])  # 32 draft tokens a step


def test_wrong_prediction_is_rejected_and_output_unchanged(tiny_hf, default_tokenizer):
    plain = run(make_engine(tiny_hf, default_tokenizer), [request(PROMPTS[1])])[0]
    wrong = [t for t in range(1000, 1020) if t not in plain["tokens"]]
    engine = make_engine(tiny_hf, default_tokenizer)
    predicted = run(engine, [request(PROMPTS[1], prediction_token_ids=wrong)])[0]
    assert predicted["tokens"] == plain["tokens"]
    assert predicted["last"].accepted_prediction_tokens == 0
    assert predicted["last"].rejected_prediction_tokens == len(wrong)
    assert engine.stats.draft_tokens == len(wrong)


def test_edited_prediction_realigns_after_the_edit(tiny_hf, default_tokenizer):
    plain = run(make_engine(tiny_hf, default_tokenizer), [request(PROMPTS[2], max_tokens=40)])[0]
    tokens = plain["tokens"]
    edited = tokens[:10] + [4242, 4243] + tokens[12:]  # two wrong tokens in the middle
    predicted = run(make_engine(tiny_hf, default_tokenizer),
                    [request(PROMPTS[2], max_tokens=40, prediction_token_ids=edited)])[0]
    assert predicted["tokens"] == tokens
    assert predicted["last"].accepted_prediction_tokens > 20  # it went on using the draft after the edit
    assert predicted["last"].rejected_prediction_tokens >= 1


def test_seeded_sampling_output_unchanged_by_prediction(tiny_hf, default_tokenizer):
    sampled = request(PROMPTS[0], temperature=0.8, seed=1234)
    plain = run(make_engine(tiny_hf, default_tokenizer), [sampled])[0]
    half_right = plain["tokens"][:15] + [7, 7, 7] + plain["tokens"][18:]
    predicted = run(make_engine(tiny_hf, default_tokenizer),
                    [{**sampled, "prediction_token_ids": half_right}])[0]
    assert predicted["tokens"] == plain["tokens"]
    assert predicted["last"].accepted_prediction_tokens >= 15


def test_batch_of_drafting_and_plain_rows(tiny_hf, default_tokenizer):
    plains = run(make_engine(tiny_hf, default_tokenizer), [request(p) for p in PROMPTS])
    mixed = [
        request(PROMPTS[0], prediction_token_ids=plains[0]["tokens"]),
        request(PROMPTS[1]),
        request(PROMPTS[2], prediction_token_ids=plains[2]["tokens"][:20] + [5, 5, 5]),
    ]
    engine = make_engine(tiny_hf, default_tokenizer)
    results = run(engine, mixed)
    assert [r["tokens"] for r in results] == [p["tokens"] for p in plains]
    assert results[0]["last"].accepted_prediction_tokens >= len(plains[0]["tokens"]) - 3
    assert results[1]["last"].accepted_prediction_tokens == 0
    assert results[2]["last"].accepted_prediction_tokens >= 20


def test_max_tokens_and_stop_token_cut_the_draft(tiny_hf, default_tokenizer):
    plain = run(make_engine(tiny_hf, default_tokenizer), [request(PROMPTS[0], max_tokens=24)])[0]
    tokens = plain["tokens"]
    short = run(make_engine(tiny_hf, default_tokenizer),
                [request(PROMPTS[0], max_tokens=7, prediction_token_ids=tokens)])[0]
    assert short["tokens"] == tokens[:7] and short["last"].finish_reason == "length"
    stop_at = tokens[12]
    stopped_plain = run(make_engine(tiny_hf, default_tokenizer),
                        [request(PROMPTS[0], stop_token_ids=frozenset({stop_at}))])[0]
    stopped = run(make_engine(tiny_hf, default_tokenizer),
                  [request(PROMPTS[0], stop_token_ids=frozenset({stop_at}), prediction_token_ids=tokens)])[0]
    assert stopped["tokens"] == stopped_plain["tokens"] and stopped["last"].finish_reason == "stop"


def test_constrained_row_with_prediction(tiny_hf, default_tokenizer):
    compiler = ConstraintCompiler(default_tokenizer, tiny_hf.config.vocab_size, stop_token_ids=[2])
    try:
        compiled = compiler.compile(ConstraintSpec("regex", r"(ab|cd|[0-9]){4,12}"))

        def constrained(**extra):
            return request(PROMPTS[1], eos_token_ids=frozenset({2}), matcher=compiled.new_matcher(), **extra)

        plain = run(make_engine(tiny_hf, default_tokenizer, jump_forward=False), [constrained()])[0]
        guess = default_tokenizer.encode("abcd1234abab", add_special_tokens=False)
        engine = make_engine(tiny_hf, default_tokenizer, jump_forward=False)
        predicted = run(engine, [constrained(prediction_token_ids=plain["tokens"][:-1] + guess)])[0]
        assert predicted["tokens"] == plain["tokens"]
        assert predicted["last"].accepted_prediction_tokens >= len(plain["tokens"]) - 2
        assert engine.stats.failed_sequences == 0
    finally:
        compiler.close()
