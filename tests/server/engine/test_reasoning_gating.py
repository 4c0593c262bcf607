"""The engine's reasoning phase: the constraint sleeps while the model thinks, then starts fresh.

Driven step by step on the tiny random-weight Llama (no HTTP). The matchers here only accept a
few digit tokens, so any consultation inside the reasoning segment would fail the sequence.
"""

from __future__ import annotations

import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest, ReasoningPhase

PROMPT = [1, 17, 305, 2044, 77]
EOS = 2


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


@pytest.fixture
def make_engine(tiny_hf, default_tokenizer):
    engines: list[Engine] = []

    def make(**kwargs) -> Engine:
        runner = ModelRunner.for_sequences(tiny_hf, 4, 512)
        engine = Engine(runner, default_tokenizer, max_batch_size=4, max_model_len=512, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def ids(default_tokenizer):
    def encode(text: str) -> tuple[int, ...]:
        return tuple(default_tokenizer.encode(text, add_special_tokens=False))

    return encode


class DigitsMatcher:
    """Allows only ``allowed`` tokens and terminates after ``length`` of them; records every call."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed = allowed
        self.length = length
        self.accepted: list[int] = []
        self.fills = 0

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.fills += 1
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token // 32] |= _bit(token % 32)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def forced_tokens(self) -> list[int]:
        return []


def _bit(position: int) -> int:
    return (1 << position) - (1 << 32) if position == 31 else 1 << position  # int32 two's complement


def run(engine: Engine, **fields) -> dict:
    result = {"tokens": [], "text": "", "finish": None, "error": None}

    def sink(delta):
        result["tokens"] += delta.token_ids
        result["text"] += delta.text
        if delta.finish_reason:
            result["finish"], result["error"] = delta.finish_reason, delta.error

    engine.submit(GenerationRequest(request_id="r", sink=sink, eos_token_ids=frozenset({EOS}), **fields))
    for _ in range(500):
        if result["finish"]:
            return result
        engine.step()
    raise AssertionError("engine did not finish")


def digits(ids) -> set[int]:
    return {ids(str(d))[0] for d in range(10)}


def test_natural_end_marker_starts_the_constraint_fresh(make_engine, ids):
    end = ids("</think>")
    marker = end[-1]
    allowed = digits(ids)
    matcher = DigitsMatcher(allowed, length=4)
    # The end marker is its last token alone here; it is banned for 3 tokens, then all but certain.
    params = SamplingParams(temperature=1.0, seed=3, min_tokens=3, banned_until_min_tokens=frozenset({marker}),
                            logit_bias={marker: 100.0})
    phase = ReasoningPhase(end_ids=(marker,), answer_prefix_ids=ids("\n\n"))
    out = run(make_engine(), prompt_token_ids=PROMPT, params=params, max_tokens=40, matcher=matcher, reasoning=phase)
    assert out["finish"] == "stop", out
    cut = out["tokens"].index(marker)
    assert cut == 3  # three free reasoning tokens (any token: the matcher was never asked)
    answer = out["tokens"][cut + 1 + len(phase.answer_prefix_ids):]
    assert out["tokens"][cut + 1: cut + 1 + len(phase.answer_prefix_ids)] == list(phase.answer_prefix_ids)
    assert matcher.accepted == answer and len(answer) == 4
    assert set(answer) <= allowed
    assert matcher.fills == 4  # masks only for the answer's tokens


def test_budget_forces_the_end_marker_then_the_answer(make_engine, ids):
    start, end = ids("<think>"), ids("</think>")
    allowed = digits(ids)
    matcher = DigitsMatcher(allowed, length=3)
    phase = ReasoningPhase(end_ids=end, start_ids=start, budget=6)
    params = SamplingParams(temperature=1.0, seed=11)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=params, max_tokens=60, matcher=matcher, reasoning=phase)
    assert out["finish"] == "stop", out
    tokens = out["tokens"]
    assert tuple(tokens[: len(start)]) == start
    reasoning_end = len(start) + 6
    assert tuple(tokens[reasoning_end: reasoning_end + len(end)]) == end
    assert tokens[reasoning_end + len(end):] == matcher.accepted
    assert len(matcher.accepted) == 3 and matcher.fills == 3
    assert out["text"].startswith("<think>") and "</think>" in out["text"]


def test_budget_zero_answers_at_once(make_engine, ids):
    end = ids("</think>")
    matcher = DigitsMatcher(digits(ids), length=2)
    phase = ReasoningPhase(end_ids=end, budget=0)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, seed=1), max_tokens=20,
              matcher=matcher, reasoning=phase)
    assert tuple(out["tokens"][: len(end)]) == end
    assert out["tokens"][len(end):] == matcher.accepted and len(matcher.accepted) == 2


def test_eos_while_thinking_ends_the_reasoning_not_the_answer(make_engine, ids):
    end = ids("</think>")
    matcher = DigitsMatcher(digits(ids), length=2)
    params = SamplingParams(temperature=1.0, seed=5, min_tokens=2, banned_until_min_tokens=frozenset({EOS}),
                            logit_bias={EOS: 100.0})  # EOS as soon as it is allowed
    phase = ReasoningPhase(end_ids=end)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=params, max_tokens=30, matcher=matcher, reasoning=phase)
    assert out["finish"] == "stop", out
    assert EOS not in out["tokens"][:2 + len(end)]
    assert tuple(out["tokens"][2: 2 + len(end)]) == end
    assert out["tokens"][2 + len(end):] == matcher.accepted and len(matcher.accepted) == 2


def test_budget_without_constraint_and_max_tokens_counts_everything(make_engine, ids):
    start, end = ids("<think>"), ids("</think>")
    phase = ReasoningPhase(end_ids=end, start_ids=start, budget=4)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, seed=2,
              banned_until_min_tokens=frozenset({EOS}), min_tokens=20), max_tokens=20, reasoning=phase)
    assert out["finish"] == "length"
    assert len(out["tokens"]) == 20  # reasoning and answer share max_tokens
    assert tuple(out["tokens"][len(start) + 4: len(start) + 4 + len(end)]) == end


def test_device_dfa_attached_after_reasoning(make_engine, ids, default_tokenizer):
    compiler = ConstraintCompiler(default_tokenizer, len(default_tokenizer), stop_token_ids=[EOS])
    try:
        compiled = compiler.compile(ConstraintSpec("regex", r"[0-9]{3}"))
        end = ids("</think>")
        phase = ReasoningPhase(end_ids=end, budget=5)
        out = run(make_engine(), prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, seed=9),
                  max_tokens=40, matcher=compiled.new_matcher(), token_dfa=compiled.token_dfa(), reasoning=phase)
    finally:
        compiler.close()
    assert out["finish"] == "stop", out
    assert tuple(out["tokens"][5: 5 + len(end)]) == end
    answer = default_tokenizer.decode(out["tokens"][5 + len(end):], skip_special_tokens=True)
    assert len(answer) == 3 and answer.isdigit(), answer


def test_without_reasoning_the_constraint_applies_from_the_first_token(make_engine, ids):
    allowed = digits(ids)
    matcher = DigitsMatcher(allowed, length=3)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, seed=4), max_tokens=10,
              matcher=matcher)
    assert out["tokens"] == matcher.accepted and len(out["tokens"]) == 3


def test_phase_needs_an_end_marker():
    with pytest.raises(ValueError):
        ReasoningPhase(end_ids=())


def test_max_tokens_spent_on_the_forced_opening(make_engine, ids):
    start, end = ids("<think>"), ids("</think>")
    phase = ReasoningPhase(end_ids=end, start_ids=start, budget=3)
    out = run(make_engine(), prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, seed=1),
              max_tokens=len(start), matcher=DigitsMatcher(digits(ids), length=2), reasoning=phase)
    assert out["finish"] == "length" and tuple(out["tokens"]) == start


class Script:
    """A client logit processor writing ``tokens`` first (one per step), then leaving the logits be."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list):
            done = len(params["__req__"].output_ids)
            if done < len(self.tokens):
                logits[row, :] = -float("inf")
                logits[row, self.tokens[done]] = 0.0
        return logits


@pytest.mark.parametrize("with_text", [True, False])
def test_end_marker_written_in_other_tokens_ends_the_reasoning(make_engine, ids, with_text):
    """``</think>`` is no single token of this tokenizer: written one character per token (not its
    ``end_ids``), the reasoning still ends by its text and the constraint starts; without
    ``end_text`` (token ids only) the answer would never be constrained."""
    end = ids("</think>")
    assert len(end) > 1
    chars = [ids(c) for c in "</think>"]
    assert all(len(c) == 1 for c in chars)
    script = list(ids("Hmm.")) + [c[0] for c in chars]
    assert script[-len(end):] != list(end)
    matcher = DigitsMatcher(digits(ids), length=4)
    phase = ReasoningPhase(end_ids=end, answer_prefix_ids=ids("\n\n"), end_text="</think>" if with_text else "")
    params = SamplingParams(temperature=0.0, custom_processor=Script(script))
    out = run(make_engine(), prompt_token_ids=PROMPT, params=params, max_tokens=30, matcher=matcher, reasoning=phase)
    assert out["tokens"][: len(script)] == script
    if not with_text:
        assert matcher.fills == 0 and out["finish"] == "length"
        return
    assert out["finish"] == "stop", out
    rest = out["tokens"][len(script):]
    assert rest[: len(phase.answer_prefix_ids)] == list(phase.answer_prefix_ids)
    assert matcher.accepted == rest[len(phase.answer_prefix_ids):] and len(matcher.accepted) == 4
