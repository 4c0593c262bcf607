"""Failures stay per sequence (or per step), the waiting queue is bounded, engine death is visible."""

from __future__ import annotations

import threading

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import CONSTRAINT_TIMEOUT, Engine, EngineDead, EngineOverloaded
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest, SequenceDelta

PROMPT_A = [1, 17, 305, 2044, 77]
PROMPT_B = [1, 9, 9, 811, 4000, 12]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


@pytest.fixture
def make_engine(tiny_hf, default_tokenizer):
    engines: list[Engine] = []

    def make(slots: int = 4, **kwargs) -> Engine:
        runner = ModelRunner.for_sequences(tiny_hf, slots, 512)
        engine = Engine(runner, default_tokenizer, max_batch_size=slots, max_model_len=512, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


class Collector:
    """A sink that records every delta of one sequence."""

    def __init__(self) -> None:
        self.deltas: list[SequenceDelta] = []
        self.done = threading.Event()

    def __call__(self, delta: SequenceDelta) -> None:
        self.deltas.append(delta)
        if delta.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def finish(self) -> str | None:
        return self.deltas[-1].finish_reason if self.deltas else None

    @property
    def error(self) -> str | None:
        return self.deltas[-1].error if self.deltas else None

    @property
    def finals(self) -> int:
        return sum(d.finish_reason is not None for d in self.deltas)


class FakeMatcher:
    """Allows every token; ``fail`` names a method that raises from its ``after``-th call on."""

    def __init__(self, fail: str | None = None, after: int = 2, empty_mask: bool = False) -> None:
        self.fail, self.after, self.empty_mask = fail, after, empty_mask
        self.calls: dict[str, int] = {}

    def _tick(self, name: str) -> bool:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.calls[name] >= self.after

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        late = self._tick("fill_bitmask")
        if late and self.fail == "fill_bitmask":
            raise RuntimeError("mask boom")
        bitmask[row] = 0 if late and self.empty_mask else -1

    def accept_token(self, token: int) -> bool:
        if self._tick("accept_token") and self.fail == "accept_token":
            raise RuntimeError("accept boom")
        return True

    def forced_tokens(self) -> list[int]:
        if self._tick("forced_tokens") and self.fail == "forced_tokens":
            raise RuntimeError("forced boom")
        return []

    def is_terminated(self) -> bool:
        if self._tick("is_terminated") and self.fail == "is_terminated":
            raise RuntimeError("terminated boom")
        return False


def request(request_id: str, sink, prompt=PROMPT_A, max_tokens: int = 12, **extra) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_token_ids=list(prompt),
                             params=SamplingParams(temperature=0.0), max_tokens=max_tokens, sink=sink, **extra)


def step_until_done(engine: Engine, sinks: list[Collector], limit: int = 500) -> None:
    for _ in range(limit):
        if all(s.finish for s in sinks):
            return
        engine.step()
    raise AssertionError("engine did not finish")


def free_alone(make_engine) -> list[int]:
    engine = make_engine()
    sink = Collector()
    engine.submit(request("free", sink))
    step_until_done(engine, [sink])
    assert sink.finish == "length"
    return sink.tokens


# ---------------------------------------------------------------------- per-sequence failures

@pytest.mark.parametrize("method", ["fill_bitmask", "accept_token", "forced_tokens", "is_terminated"])
def test_failing_matcher_fails_only_its_sequence(make_engine, method):
    expected = free_alone(make_engine)
    engine = make_engine()
    free, bad, fine = Collector(), Collector(), Collector()
    engine.submit_all([request("free", free)])
    engine.submit_all([request("bad", bad, prompt=PROMPT_B, matcher=FakeMatcher(fail=method, after=3))])
    engine.submit_all([request("fine", fine, prompt=PROMPT_B, matcher=FakeMatcher())])
    step_until_done(engine, [free, bad, fine])
    assert free.tokens == expected and free.finish == "length"
    assert bad.finish == "error" and bad.finals == 1
    assert bad.error.startswith("constraint matcher failed: RuntimeError")
    assert fine.finish == "length" and len(fine.tokens) == 12
    assert engine.num_running == 0 and engine.stats.failed_sequences == 1


def test_empty_mask_row_ends_that_sequence(make_engine):
    expected = free_alone(make_engine)
    engine = make_engine()
    free, bad = Collector(), Collector()
    engine.submit_all([request("bad", bad, prompt=PROMPT_B, matcher=FakeMatcher(empty_mask=True, after=2))])
    engine.submit_all([request("free", free)])
    step_until_done(engine, [free, bad])
    assert bad.finish == "error" and "no token is allowed" in bad.error
    assert len(bad.tokens) == 1  # the first (full-mask) step's token only, nothing sampled from an empty mask
    assert free.tokens == expected


class BrokenDetokenizer:
    def push(self, token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    def flush(self):
        return ""


class BrokenStops:
    def feed(self, text):
        raise ValueError("stops boom")

    def flush(self):
        return ""


@pytest.mark.parametrize("part,message", [("detokenizer", "detokenizer failed"),
                                          ("stops", "stop-string matching failed")])
def test_failing_text_handling_fails_only_its_sequence(make_engine, monkeypatch, part, message):
    expected = free_alone(make_engine)
    engine = make_engine()
    new_sequence = engine._new_sequence

    def sabotaged(req):
        seq = new_sequence(req)
        if req.request_id == "bad":
            setattr(seq, part, BrokenDetokenizer() if part == "detokenizer" else BrokenStops())
        return seq

    monkeypatch.setattr(engine, "_new_sequence", sabotaged)
    free, bad = Collector(), Collector()
    engine.submit_all([request("bad", bad, prompt=PROMPT_B)])
    engine.submit_all([request("free", free)])
    step_until_done(engine, [free, bad])
    assert bad.finish == "error" and bad.error.startswith(message)
    assert free.tokens == expected


def test_failure_while_finishing_replaces_the_finish_reason(make_engine, monkeypatch):
    engine = make_engine()
    new_sequence = engine._new_sequence

    def sabotaged(req):
        seq = new_sequence(req)
        monkeypatch.setattr(seq.detokenizer, "flush", lambda: 1 / 0)
        return seq

    monkeypatch.setattr(engine, "_new_sequence", sabotaged)
    sink = Collector()
    engine.submit_all([request("bad", sink, max_tokens=3)])
    step_until_done(engine, [sink])
    assert sink.finish == "error" and sink.error == "detokenizer failed: ZeroDivisionError: division by zero"
    assert len(sink.tokens) == 3 and sink.finals == 1


def test_broken_sink_fails_only_its_sequence(make_engine):
    expected = free_alone(make_engine)
    engine = make_engine()
    free, bad_log = Collector(), Collector()
    calls = []

    def flaky(delta):
        calls.append(delta)
        if len(calls) == 2:
            raise RuntimeError("client bug")
        bad_log(delta)

    engine.submit_all([request("bad", flaky, prompt=PROMPT_B, max_tokens=50)])
    engine.submit_all([request("free", free)])
    step_until_done(engine, [free, bad_log])
    assert free.tokens == expected
    assert bad_log.finish == "error" and bad_log.error.startswith("output sink failed: RuntimeError")
    assert len(calls) == 3  # two token deltas (the second raised), then the final error delta
    assert engine.num_running == 0


def test_sequence_that_cannot_start_gets_an_error(make_engine):
    engine = make_engine()
    bad, free = Collector(), Collector()
    engine.submit_all([request("bad", bad, token_dfa=object())])
    engine.submit_all([request("free", free)])
    step_until_done(engine, [free, bad])
    assert bad.finish == "error" and bad.error.startswith("sequence could not start")
    assert free.finish == "length"
    assert engine.num_waiting == 0 and engine.waiting_tokens == 0


# ---------------------------------------------------------------------- batch-wide failures

def fail_once(monkeypatch, target, name: str, at_call: int, exc: BaseException) -> None:
    """Make ``target.name`` raise ``exc`` on its ``at_call``-th call only."""
    original = getattr(target, name)
    count = [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] == at_call:
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_batch_failure_fails_only_that_steps_batch(make_engine, monkeypatch, where):
    expected = free_alone(make_engine)
    engine = make_engine(slots=2)
    target, name = (engine.runner, "forward") if where == "forward" else (engine.sampler, "sample_async")
    fail_once(monkeypatch, target, name, at_call=3, exc=RuntimeError("device boom"))
    first, second, waiting = Collector(), Collector(), Collector()
    engine.submit_all([request("a", first, prompt=PROMPT_B), request("a", second, prompt=PROMPT_B)])
    engine.submit_all([request("free", waiting)])
    step_until_done(engine, [first, second, waiting])
    message = "model forward failed" if where == "forward" else "sampler failed"
    assert first.finish == second.finish == "error" and first.error.startswith(message)
    assert waiting.tokens == expected and waiting.finish == "length"
    assert engine.stats.failed_batches == 1
    later = Collector()
    engine.submit_all([request("later", later)])
    step_until_done(engine, [later])
    assert later.tokens == expected


def test_engine_thread_survives_a_bug_in_the_step(make_engine, monkeypatch):
    engine = make_engine()
    fail_once(monkeypatch, engine.drafts, "plan", at_call=2, exc=RuntimeError("loop bug"))
    hit = Collector()
    engine.submit_all([request("hit", hit)])
    engine.start()
    assert hit.done.wait(60)
    assert hit.finish == "error" and hit.error.startswith("engine step failed: RuntimeError: loop bug")
    later = Collector()
    engine.submit_all([request("later", later)])
    assert later.done.wait(60)
    assert later.finish == "length" and engine.alive and engine.error is None
    assert engine.stats.failed_steps == 1


# ---------------------------------------------------------------------- engine death

class Fatal(BaseException):
    """Stands for anything that is no ``Exception`` (and so escapes every handler)."""


def test_engine_death_is_visible_and_every_pending_sequence_gets_an_error(make_engine, monkeypatch):
    engine = make_engine(slots=1, speculation=False)  # counts tokens per forward
    fail_once(monkeypatch, engine, "_forward", at_call=3, exc=Fatal("dead"))
    running, waiting = Collector(), Collector()
    engine.submit_all([request("running", running, max_tokens=100), request("waiting", waiting)])
    engine.start()
    engine._thread.join(60)
    assert not engine._thread.is_alive()
    assert not engine.alive and isinstance(engine.error, Fatal)
    for sink in (running, waiting):
        assert sink.finish == "error" and sink.finals == 1
        assert sink.error == "engine stopped: Fatal: dead"
    assert len(running.tokens) == 2 and waiting.tokens == []
    assert engine.num_running == engine.num_waiting == 0
    with pytest.raises(EngineDead):
        engine.submit_all([request("late", Collector())])


def test_sequences_never_seen_by_a_dying_engine_get_an_error(make_engine, monkeypatch):
    engine = make_engine()
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(Fatal("at once")))
    sinks = [Collector(), Collector()]
    engine.submit_all([request("a", sinks[0]), request("a", sinks[1])])
    engine.start()
    engine._thread.join(60)
    assert not engine.alive and isinstance(engine.error, Fatal)
    assert [s.finish for s in sinks] == ["error", "error"]


def test_shutdown_ends_pending_sequences(make_engine):
    engine = make_engine()
    assert not engine.alive
    first_delta = threading.Event()
    sink = Collector()

    def watch(delta):
        sink(delta)
        first_delta.set()

    engine.start()
    assert engine.alive
    engine.submit_all([request("long", watch, max_tokens=400, ignore_eos=True)])
    assert first_delta.wait(60)
    engine.shutdown()
    assert not engine.alive and engine.error is None
    assert sink.finish in ("error", "length") and sink.finals == 1
    with pytest.raises(EngineDead):
        engine.submit(request("late", Collector()))


# ---------------------------------------------------------------------- admission control

def test_submit_all_is_all_or_nothing(make_engine):
    engine = make_engine(slots=2, max_waiting_seqs=3, max_waiting_tokens=1000)
    sinks = [Collector() for _ in range(6)]
    engine.submit_all([request("a", sinks[0]), request("a", sinks[1])])
    assert engine.num_waiting == 2 and engine.waiting_tokens == 2 * len(PROMPT_A)
    with pytest.raises(EngineOverloaded) as refused:
        engine.submit_all([request("b", sinks[2]), request("b", sinks[3])])
    assert refused.value.retry_after >= 1
    assert engine.num_waiting == 2
    engine.step()  # both enter the running batch
    assert engine.num_waiting == 0 and engine.num_running == 2
    engine.submit_all([request("b", sinks[2]), request("b", sinks[3]), request("b", sinks[4])])
    assert engine.num_waiting == 3
    with pytest.raises(EngineOverloaded):
        engine.submit_all([request("c", sinks[5])])
    engine.abort("b")
    engine.step()  # aborts of waiting sequences take effect at once
    assert engine.num_waiting == 0
    assert [s.finish for s in sinks[2:5]] == ["abort"] * 3
    engine.submit_all([request("c", sinks[5])])
    step_until_done(engine, [sinks[0], sinks[1], sinks[5]])
    assert engine.num_running == engine.num_waiting == 0


def test_waiting_tokens_are_bounded(make_engine):
    engine = make_engine(slots=1, max_waiting_tokens=10)
    engine.submit_all([request("a", Collector(), prompt=PROMPT_B)])
    with pytest.raises(EngineOverloaded):
        engine.submit_all([request("b", Collector(), prompt=PROMPT_B)])
    assert engine.waiting_tokens == len(PROMPT_B)
    engine.step()
    assert engine.waiting_tokens == 0
    # with nothing waiting, a request over the limit is still taken (slow, never starved)
    engine.submit_all([request("b", Collector(), prompt=PROMPT_B * 3)])
    assert engine.num_waiting == 1


def test_retry_after_follows_recent_throughput(make_engine):
    engine = make_engine(slots=1, max_waiting_seqs=1)
    for i in range(3):
        sink = Collector()
        engine.submit_all([request(f"r{i}", sink, max_tokens=2)])
        step_until_done(engine, [sink])
    engine.submit_all([request("x", Collector())])
    with pytest.raises(EngineOverloaded) as refused:
        engine.submit_all([request("y", Collector())])
    assert isinstance(refused.value.retry_after, int) and refused.value.retry_after >= 1


def test_kv_usage_counts_blocks_held(make_engine):
    engine = make_engine(slots=2)
    assert engine.kv_usage == 0.0
    sinks = [Collector(), Collector()]
    engine.submit_all([request("a", sinks[0], max_tokens=3), request("a", sinks[1], prompt=PROMPT_B, max_tokens=3)])
    engine.step()
    held = engine.blocks.blocks_for(len(PROMPT_A)) + engine.blocks.blocks_for(len(PROMPT_B))
    assert engine.kv_usage == pytest.approx(held / (engine.blocks.num_blocks - 1))  # blocks held / usable
    step_until_done(engine, sinks)
    assert engine.kv_usage == 0.0


# ---------------------------------------------------------------------- calls that never return

BOUND_S = 0.5  # the tests' --constraint-call-timeout
SAFETY_S = 60.0  # a hung call returns by then at the latest: without the bound a test fails, not hangs


class Hang:
    """What a hanging call blocks on; released when the test ends, so abandoned threads end."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self.released.wait(SAFETY_S)


@pytest.fixture
def hang():
    blocker = Hang()
    yield blocker
    blocker.released.set()


class HangingMatcher(FakeMatcher):
    """Allows every token (and every draft); ``method`` hangs from its ``after``-th call on."""

    def __init__(self, hang: Hang, method: str, after: int = 3) -> None:
        super().__init__(after=after)
        self.hang, self.method = hang, method

    def _maybe_hang(self, name: str) -> None:
        if self._tick(name) and name == self.method:
            self.hang()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._maybe_hang("fill_bitmask")
        bitmask[row] = -1

    def accept_token(self, token: int) -> bool:
        self._maybe_hang("accept_token")
        return True

    def forced_tokens(self) -> list[int]:
        self._maybe_hang("forced_tokens")
        return []

    def is_terminated(self) -> bool:
        self._maybe_hang("is_terminated")
        return False

    def valid_prefix(self, ids: list[int]) -> int:
        self._maybe_hang("valid_prefix")
        return len(ids)


def assert_timed_out(sink: Collector, what: str) -> None:
    from server.generation import generation_error

    assert sink.finish == "error" and sink.finals == 1
    assert sink.error.startswith(f"{CONSTRAINT_TIMEOUT}: {what} took over {BOUND_S:g} s")
    error = generation_error(sink.error)
    assert error.status == 400 and error.code == "constraint_timeout"


def serves_again(engine: Engine, expected: list[int]) -> None:
    later, constrained = Collector(), Collector()
    engine.submit_all([request("later", later), request("constrained", constrained, matcher=FakeMatcher())])
    step_until_done(engine, [later, constrained])
    assert later.tokens == expected and constrained.finish == "length"


@pytest.mark.parametrize("method,what,overlap", [
    ("fill_bitmask", "filling its token mask", False),
    ("fill_bitmask", "filling its token mask", True),
    ("accept_token", "taking a token", False),
    ("accept_token", "taking a token", True),
    ("forced_tokens", "taking a token", False),
    ("is_terminated", "taking a token", False),
    ("valid_prefix", "drafting", False),  # cutting a predicted output's draft to the grammar
])
def test_hanging_matcher_ends_only_its_sequence(make_engine, hang, method, what, overlap):
    expected = free_alone(make_engine)
    engine = make_engine(constraint_call_timeout=BOUND_S, overlap=overlap)
    fine_alone = make_engine()
    reference = Collector()
    fine_alone.submit_all([request("fine", reference, prompt=PROMPT_B, matcher=FakeMatcher())])
    step_until_done(fine_alone, [reference])
    free, stuck, fine = Collector(), Collector(), Collector()
    drafting = method == "valid_prefix"  # the first draft, of a prediction, is cut at once
    draft = {"prediction_token_ids": [5, 6, 7]} if drafting else {}
    matcher = HangingMatcher(hang, method, after=1 if drafting else 3)
    engine.submit_all([request("free", free)])
    engine.submit_all([request("stuck", stuck, prompt=PROMPT_B, matcher=matcher, **draft)])
    engine.submit_all([request("fine", fine, prompt=PROMPT_B, matcher=FakeMatcher())])
    step_until_done(engine, [free, stuck, fine])
    assert_timed_out(stuck, what)
    assert hang.calls == 1 and engine.bound.calls.abandoned == 1
    assert free.tokens == expected and free.finish == "length"
    assert fine.tokens == reference.tokens and fine.finish == "length"
    serves_again(engine, expected)


def test_engine_thread_lives_on_past_a_hanging_matcher(make_engine, hang):
    expected = free_alone(make_engine)
    engine = make_engine(constraint_call_timeout=BOUND_S)
    engine.start()
    free, stuck = Collector(), Collector()
    engine.submit_all([request("stuck", stuck, prompt=PROMPT_B, matcher=HangingMatcher(hang, "fill_bitmask"))])
    engine.submit_all([request("free", free)])
    assert stuck.done.wait(SAFETY_S / 2) and free.done.wait(SAFETY_S / 2)
    assert_timed_out(stuck, "filling its token mask")
    assert free.tokens == expected
    later = Collector()
    engine.submit_all([request("later", later)])
    assert later.done.wait(SAFETY_S / 2)
    assert later.tokens == expected and engine.alive


class SleepingProcessor:
    """A client logit processor that changes nothing, and hangs on rows asking it to."""

    def __init__(self, hang: Hang) -> None:
        self.hang = hang

    def __call__(self, logits, custom_param_list=None):
        if any(params.get("hang") for params in custom_param_list):
            self.hang()
        return logits


def test_hanging_logit_processor_ends_only_its_sequence(make_engine, hang):
    expected = free_alone(make_engine)
    engine = make_engine(constraint_call_timeout=BOUND_S)
    processor = SleepingProcessor(hang)

    def with_processor(request_id: str, sink, **custom_params) -> GenerationRequest:
        params = SamplingParams(temperature=0.0, custom_processor=processor, custom_params=custom_params)
        return GenerationRequest(request_id=request_id, prompt_token_ids=list(PROMPT_A), params=params,
                                 max_tokens=12, sink=sink)

    free, stuck, fine = Collector(), Collector(), Collector()
    engine.submit_all([request("free", free), with_processor("stuck", stuck, hang=True),
                       with_processor("fine", fine)])
    step_until_done(engine, [free, stuck, fine])
    assert stuck.finish == "error" and stuck.finals == 1
    assert stuck.error == f"custom_logit_processor timed out: the call did not return within {BOUND_S:g} s"
    assert free.tokens == expected and fine.tokens == expected  # the processor changes nothing
    # the two rows' call hung, then the stuck row's call alone: nothing else waited for
    assert hang.calls == 2 and engine.bound.calls.abandoned == 2
    serves_again(engine, expected)
