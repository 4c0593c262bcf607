"""Engine behaviour, driven step by step in the test thread (no HTTP)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                                      "label": {"enum": ["spam", "ham"]}},
     "required": ["ok", "score", "label"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def real_parts(default_dir, default_tokenizer):
    hf = load_hf_model(default_dir, torch.float32, torch.device("cpu"))
    compiler = ConstraintCompiler(default_tokenizer, hf.config.vocab_size, stop_token_ids=[2])
    yield hf, default_tokenizer, compiler
    compiler.close()


def make_engine(hf, tokenizer, *, jump_forward: bool = True, slots: int = 8, mask_fill_threads: int = 0) -> Engine:
    runner = ModelRunner.for_sequences(hf, slots, 1024)
    return Engine(runner, tokenizer, max_batch_size=slots, max_model_len=1024, jump_forward=jump_forward,
                  mask_fill_threads=mask_fill_threads)


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def run(engine: Engine, requests: list[dict]) -> list[dict]:
    """Submit all requests at once and step until every one has finished."""
    results = [{"tokens": [], "logprobs": [], "text": "", "finish": None} for _ in requests]

    def sink_for(i):
        def sink(delta):
            results[i]["tokens"] += delta.token_ids
            results[i]["logprobs"] += delta.logprobs or []
            results[i]["text"] += delta.text
            results[i]["finish"] = delta.finish_reason or results[i]["finish"]
        return sink

    for i, fields in enumerate(requests):
        engine.submit(GenerationRequest(request_id=f"r{i}", sink=sink_for(i), eos_token_ids=frozenset({2}), **fields))
    for _ in range(5000):
        if all(r["finish"] for r in results):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


def greedy(prompt: list[int], max_tokens: int = 40, logprobs: int | None = None, **extra) -> dict:
    """A greedy request; ``logprobs``: how many top alternatives each token reports (None: no logprobs)."""
    params = SamplingParams(temperature=0.0, logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    return {"prompt_token_ids": prompt, "params": params, "max_tokens": max_tokens, **extra}


def test_free_row_identical_with_constrained_neighbours(real_parts):
    hf, tokenizer, compiler = real_parts
    free = greedy(prompt_ids(tokenizer, "Tell me about the moon."), max_tokens=24)
    alone = run(make_engine(hf, tokenizer), [free])[0]
    neighbours = []
    for i, schema in enumerate(SCHEMAS):
        matcher = compiler.compile(ConstraintSpec("json_schema", schema)).new_matcher()
        neighbours.append(greedy(prompt_ids(tokenizer, f"JSON please #{i}"), matcher=matcher))
    regex = compiler.compile(ConstraintSpec("regex", r"[A-Z][a-z]{2,8}")).new_matcher()
    neighbours.append({"prompt_token_ids": prompt_ids(tokenizer, "A name"), "max_tokens": 12, "matcher": regex,
                       "params": SamplingParams(temperature=0.8, seed=5)})
    mixed = run(make_engine(hf, tokenizer), [free, *neighbours])
    assert mixed[0]["tokens"] == alone["tokens"]


NEAR_TIE = 1e-3  # logit gap under which float noise between two attention paths may flip a greedy pick


def assert_masked_greedy(hf, matcher, prompt: list[int], output: dict) -> None:
    """``output`` is greedy decoding under the constraint, checked against transformers' own
    forward over the prompt and the output's tokens (teacher-forced): every token is allowed by
    the constraint, and every sampled one is the most likely allowed token (or within NEAR_TIE of
    it). Forced tokens (jump-forward: logprob 0 with no alternative listed) only need be allowed:
    they are the automaton's canonical tokenization of text the constraint leaves no choice on."""
    tokens = output["tokens"]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    vocab = logits.shape[-1]
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for position, (token, logprob) in enumerate(zip(tokens, output["logprobs"], strict=True)):
        bitmask.zero_()
        matcher.fill_bitmask(bitmask, 0)
        allowed = ((bitmask[0].repeat_interleave(32) >> torch.arange(32).repeat(bitmask.shape[1])) & 1).bool()[:vocab]
        assert allowed[token], (position, token)
        forced = logprob.logprob == 0.0 and len(logprob.top) == 1
        if not forced:
            masked = logits[position].masked_fill(~allowed, float("-inf"))
            assert masked.max() - masked[token] < NEAR_TIE, (position, token, int(masked.argmax()))
        assert matcher.accept_token(token), (position, token)


def test_jump_forward_output_is_masked_greedy_and_saves_steps(real_parts):
    """With and without jump-forward, every output is the model's greedy decoding under its
    schema (checked against transformers' forward); jump-forward forces tokens and takes fewer
    steps. The two outputs may differ: forced text is fed in its canonical tokenization, which
    can differ from the tokens the model would have picked one by one, so the contexts differ."""
    hf, tokenizer, compiler = real_parts
    specs = [ConstraintSpec("json_schema", schema) for schema in SCHEMAS]
    prompt = prompt_ids(tokenizer, "Describe it as JSON.")
    steps = {}
    for jump in (False, True):
        engine = make_engine(hf, tokenizer, jump_forward=jump)
        requests = [greedy(prompt, max_tokens=80, logprobs=2, matcher=compiler.compile(spec).new_matcher())
                    for spec in specs]
        outputs = run(engine, requests)
        steps[jump] = engine.stats.steps
        assert (engine.stats.forced_tokens > 0) == jump
        for output, spec, schema in zip(outputs, specs, SCHEMAS):
            assert_masked_greedy(hf, compiler.compile(spec).new_matcher(), prompt, output)
            if output["finish"] == "stop":
                jsonschema.validate(json.loads(output["text"]), schema)
    assert steps[True] < steps[False]


def test_parallel_mask_fill_keeps_greedy_outputs(real_parts):
    """8 JSON-schema rows of one backend: filled in one batched call on 2 threads, the greedy
    outputs equal those of the one-thread, row-by-row fill."""
    hf, tokenizer, compiler = real_parts
    texts = {}
    for threads in (1, 2):
        requests = [
            greedy(prompt_ids(tokenizer, f"Describe item {i} as JSON."), max_tokens=16,
                   matcher=compiler.compile(ConstraintSpec("json_schema", SCHEMAS[i % len(SCHEMAS)])).new_matcher())
            for i in range(8)
        ]
        engine = make_engine(hf, tokenizer, mask_fill_threads=threads)
        texts[threads] = [r["text"] for r in run(engine, requests)]
        assert engine.stats.failed_sequences == 0
    assert texts[2] == texts[1]


def test_bad_sink_and_abort_do_not_break_the_batch(real_parts):
    hf, tokenizer, _ = real_parts
    engine = make_engine(hf, tokenizer)
    good = []

    def broken(delta):
        raise RuntimeError("client bug")

    engine.submit(GenerationRequest(request_id="bad", prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                                    max_tokens=5, sink=broken))
    engine.submit(GenerationRequest(request_id="gone", prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                                    max_tokens=50, sink=lambda d: None))
    engine.submit(GenerationRequest(request_id="good", prompt_token_ids=[4, 5, 6], params=SamplingParams(),
                                    max_tokens=6, sink=good.append, eos_token_ids=frozenset()))
    engine.step()
    engine.abort("gone")
    for _ in range(20):
        engine.step()
    assert good[-1].finish_reason == "length" and good[-1].completion_tokens == 6
    assert engine.num_running == 0


def test_device_dfa_rows_match_host_matcher_rows(real_parts):
    """Regex/choice through the device-resident DFA kernel path == through the CPU matcher."""
    hf, tokenizer, compiler = real_parts
    specs = [ConstraintSpec("regex", r"\(\d{3}\) \d{3}-\d{4}"), ConstraintSpec("choice", ["yes", "no", "maybe"])]
    compiled = [compiler.compile(spec) for spec in specs]
    assert all(c.token_dfa() is not None for c in compiled)
    outputs = {}
    for use_dfa in (False, True):
        requests = [
            greedy(prompt_ids(tokenizer, "Phone number or answer?"), max_tokens=20, matcher=c.new_matcher(),
                   token_dfa=c.token_dfa() if use_dfa else None)
            for c in compiled
        ]
        outputs[use_dfa] = [r["text"] for r in run(make_engine(hf, tokenizer), requests)]
    assert outputs[True] == outputs[False]
    assert outputs[True][1] in ("yes", "no", "maybe")


def test_a_constrained_answer_cut_inside_a_character_ends_before_it(real_parts):
    """``[\\u0400-\\u04FF]+`` with max_tokens 1..3: where the answer is cut after the first byte of
    a Cyrillic letter, its text is the letters before it, not a replacement character."""
    from server.engine.detokenizer import ends_inside_character

    hf, tokenizer, compiler = real_parts
    compiled = compiler.compile(ConstraintSpec("regex", "[\u0400-\u04FF]+"))
    engine = make_engine(hf, tokenizer)
    prompt = prompt_ids(tokenizer, "Write a word in Russian.")
    results = run(engine, [greedy(prompt, max_tokens=n, matcher=compiled.new_matcher()) for n in (1, 2, 3)])
    cut = [r for r in results if ends_inside_character(tokenizer, r["tokens"])]
    assert cut, "no answer ended inside a character: the case is not exercised"
    for result in results:
        assert "\ufffd" not in result["text"]
        assert tokenizer.decode(result["tokens"]).startswith(result["text"])
