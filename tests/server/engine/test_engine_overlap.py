"""The overlapped engine loop: the next step's forward is launched before the host reads the
sampled tokens, and the output is exactly the synchronous loop's (same seeds, same tokens, same
deltas), with constraints, jump-forward, penalties, stops, logprobs and drafts in the batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from constraints import ConstraintSpec
from server.engine.inflight import ReadyEvent
from server.engine.sequence import GenerationRequest

PROMPTS = [[1, 504, 3300, 28, 1012], [1, 77, 88, 99], [1, 2500, 314, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def make_engine(hf, tokenizer, **kwargs) -> Engine:
    runner = ModelRunner.for_sequences(hf, 4, 128, block_size=4)
    return Engine(runner, tokenizer, max_batch_size=4, max_model_len=128, **{"speculation": False, **kwargs})


def submit(engine: Engine, deltas: dict[int, list], *, sink_error_at: int | None = None) -> None:
    """Three requests of different lengths (one ends while the others run), logprobs on."""
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), SamplingParams(seed=7, temperature=0.8),
              SamplingParams(temperature=0.0, logprobs=True)]
    calls = [0] * len(PROMPTS)
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, (9, 4, 6))):
        deltas[i] = []

        def sink(delta, i=i):
            calls[i] += 1
            if i == sink_error_at and calls[i] == 2:  # once: the engine's last try gets through
                raise RuntimeError("client queue is broken")
            deltas[i].append(delta)

        engine.submit(GenerationRequest(request_id=f"r{i}", sink=sink, prompt_token_ids=prompt, params=params[i],
                                        max_tokens=max_tokens, ignore_eos=True))


def run_to_end(engine: Engine, deltas: dict[int, list]) -> None:
    for _ in range(200):
        if deltas and all(d and d[-1].finish_reason for d in deltas.values()):
            return
        engine.step()
    raise AssertionError("engine did not finish")


def summary(deltas: dict[int, list]) -> dict[int, list]:
    return {i: [(d.token_ids, d.text, d.finish_reason, d.error, logprob_ids(d.logprobs), d.completion_tokens)
                for d in ds] for i, ds in deltas.items()}


def logprob_ids(logprobs) -> list | None:
    return None if logprobs is None else [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs]


def logprob_values(deltas: dict[int, list]) -> list[float]:
    return [v for ds in deltas.values() for d in ds for lp in d.logprobs or () for v in [lp.logprob, *(v for _, v in lp.top)]]


def assert_same_logprobs(a: list[float], b: list[float]) -> None:
    """Equal up to the last bits: a wasted row in the overlapped loop's forward changes the batch's
    shape, and with it the rounding of CPU matmuls (never the tokens)."""
    assert len(a) == len(b) and a == pytest.approx(b, abs=1e-4, rel=0)


def test_overlapped_loop_gives_the_same_deltas(tiny_hf, default_tokenizer):
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_hf, default_tokenizer, overlap=overlap)
        deltas: dict[int, list] = {}
        submit(engine, deltas)
        run_to_end(engine, deltas)
        engine.flush()
        assert engine._inflight is None and not engine.scheduler.running
        results[overlap] = summary(deltas), logprob_values(deltas)
    assert results[True][0] == results[False][0]
    assert_same_logprobs(results[True][1], results[False][1])
    assert [len(ds) for ds in results[True][0].values()] == [9, 4, 6]  # one delta per sampled token


class RecordingRunner:
    """The runner, with its forwards and the engine's reads of the sampled ids put in order."""

    def __init__(self, runner, forward_ms: float = 0.0) -> None:
        self.runner = runner
        self.forward_ms = forward_ms  # what the forward's timing events report
        self.log: list[tuple[str, int]] = []
        self.forwards = 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def forward(self, batch):
        self.forwards += 1
        self.log.append(("forward", self.forwards))
        return self.runner.forward(batch)

    def new_event(self):
        return RecordingEvent(self)


class RecordingEvent(ReadyEvent):
    """Logs ("read", k) when the engine waits on it, k = the forwards launched when it was recorded."""

    def __init__(self, runner: RecordingRunner) -> None:
        self.runner = runner
        self.after = 0

    def record(self, stream=None) -> None:
        self.after = self.runner.forwards

    def synchronize(self) -> None:
        self.runner.log.append(("read", self.after))

    def elapsed_time(self, end) -> float:
        return self.runner.forward_ms


def test_the_host_reads_a_steps_tokens_after_the_next_forward_is_launched(tiny_hf, default_tokenizer):
    runner = RecordingRunner(ModelRunner.for_sequences(tiny_hf, 4, 128, block_size=4), forward_ms=5.0)
    engine = Engine(runner, default_tokenizer, max_batch_size=4, max_model_len=128, overlap=True,
                    speculation=False)
    deltas: dict[int, list] = {}
    submit(engine, deltas)
    for _ in range(3):
        engine.step()
    assert runner.log == [("forward", 1), ("forward", 2), ("read", 1), ("forward", 3), ("read", 2)]
    run_to_end(engine, deltas)


def test_the_synchronous_loop_reads_before_the_next_launch(tiny_hf, default_tokenizer):
    runner = RecordingRunner(ModelRunner.for_sequences(tiny_hf, 4, 128, block_size=4))
    engine = Engine(runner, default_tokenizer, max_batch_size=4, max_model_len=128, overlap=False,
                    speculation=False)
    deltas: dict[int, list] = {}
    submit(engine, deltas)
    for _ in range(3):
        engine.step()
    assert runner.log == [("forward", 1), ("read", 1), ("forward", 2), ("read", 2), ("forward", 3), ("read", 3)]


def constrained_engine(hf, tokenizer, compiler, forward_ms: float) -> tuple[Engine, RecordingRunner, dict]:
    """Three json_schema rows on an engine whose forwards take ``forward_ms`` on the device."""
    runner = RecordingRunner(ModelRunner.for_sequences(hf, 4, 256, block_size=4), forward_ms=forward_ms)
    engine = Engine(runner, tokenizer, max_batch_size=4, max_model_len=256, overlap=True, jump_forward=False,
                    speculation=False)
    compiled = compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    deltas: dict[int, list] = {}
    for i in range(3):
        deltas[i] = []
        engine.submit(GenerationRequest(request_id=f"c{i}", sink=deltas[i].append, prompt_token_ids=PROMPTS[i],
                                        params=SamplingParams(temperature=0.0), max_tokens=40,
                                        matcher=compiled.new_matcher(), eos_token_ids=frozenset({2})))
    return engine, runner, deltas


def reads_after_the_next_launch(log: list[tuple[str, int]]) -> int:
    """Reads of a step's tokens that came after a later step's forward was launched."""
    launched, late = 0, 0
    for kind, number in log:
        if kind == "forward":
            launched = number
        elif launched > number:
            late += 1
    return late


def test_the_loop_reads_first_while_the_mask_fill_outlasts_the_forward(tiny_hf, default_tokenizer, default_compiler):
    """Measured per step: a mask fill longer than the forward (a forward timed at 0 ms) makes
    the loop read the tokens before it launches, so the fill runs while the device computes;
    a long forward keeps the launch first. The output is the same."""
    outputs = {}
    for forward_ms in (0.0, 1e6):
        engine, runner, deltas = constrained_engine(tiny_hf, default_tokenizer, default_compiler, forward_ms)
        run_to_end(engine, deltas)
        engine.flush()
        outputs[forward_ms] = [[t for d in ds for t in d.token_ids] for ds in deltas.values()]
        reads_late = reads_after_the_next_launch(runner.log)
        if forward_ms:
            assert engine.policy.launch_first and reads_late == engine.stats.overlapped_steps > 5
        else:
            assert not engine.policy.launch_first and reads_late == engine.stats.overlapped_steps <= 2
    assert outputs[0.0] == outputs[1e6]


def test_a_steps_deltas_go_out_during_the_next_step(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, overlap=True)
    deltas: dict[int, list] = {}
    submit(engine, deltas)
    engine.step()  # prefill; the first tokens are still on the device
    assert [len(d) for d in deltas.values()] == [0, 0, 0]
    engine.step()  # read and delivered after this step's forward launch
    assert [len(d) for d in deltas.values()] == [1, 1, 1]
    run_to_end(engine, deltas)
    assert all(d[-1].finish_reason == "length" for d in deltas.values())


def greedy_run(hf, tokenizer, overlap: bool, **fields) -> tuple[list[int], int]:
    """One greedy request on PROMPTS[0] to its end (the presence penalty keeps the random model from
    repeating one token): (its tokens, decode rows the engine fed)."""
    engine = make_engine(hf, tokenizer, overlap=overlap)
    deltas: dict[int, list] = {0: []}
    engine.submit(GenerationRequest(request_id="g", sink=deltas[0].append, prompt_token_ids=PROMPTS[0],
                                    params=SamplingParams(temperature=0.0, presence_penalty=2.0), ignore_eos=True,
                                    **fields))
    run_to_end(engine, deltas)
    engine.flush()
    return [t for d in deltas[0] for t in d.token_ids], engine.stats.decode_tokens


def test_a_row_ending_by_its_budget_is_not_fed_again(tiny_hf, default_tokenizer):
    for max_tokens in (1, 12):
        sync = greedy_run(tiny_hf, default_tokenizer, False, max_tokens=max_tokens)
        assert greedy_run(tiny_hf, default_tokenizer, True, max_tokens=max_tokens) == sync


def test_a_row_ending_on_a_stop_token_costs_one_forward_row(tiny_hf, default_tokenizer):
    tokens, _ = greedy_run(tiny_hf, default_tokenizer, False, max_tokens=12)
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop = frozenset({tokens[at]})
    sync_tokens, sync_rows = greedy_run(tiny_hf, default_tokenizer, False, max_tokens=12, stop_token_ids=stop)
    overlap_tokens, overlap_rows = greedy_run(tiny_hf, default_tokenizer, True, max_tokens=12, stop_token_ids=stop)
    assert sync_tokens == overlap_tokens == tokens[: at + 1]
    assert overlap_rows == sync_rows + 1  # the row fed after the stop token, read one step late


def test_a_failing_sink_fails_only_its_sequence(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, overlap=True)
    deltas: dict[int, list] = {}
    submit(engine, deltas, sink_error_at=0)
    for _ in range(200):
        if all(d and d[-1].finish_reason for d in (deltas[1], deltas[2])) and not engine.scheduler.running:
            break
        engine.step()
    assert deltas[0][0].finish_reason is None and len(deltas[0]) == 2
    assert deltas[0][-1].finish_reason == "error" and "output sink failed" in deltas[0][-1].error
    assert [d[-1].finish_reason for d in (deltas[1], deltas[2])] == ["length", "length"]


def test_overlap_is_off_on_the_cpu_by_default(tiny_hf, default_tokenizer):
    assert make_engine(tiny_hf, default_tokenizer).overlap is False


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "tags", "ok"], "additionalProperties": False}


def mixed_requests(compiler, sink_for) -> list[GenerationRequest]:
    """Constrained rows (greedy and seeded) with jump-forward, free rows with penalties, logprobs,
    a stop string and bad words, and a predicted output (a draft: the loop reads tokens first)."""
    compiled = compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    regex = compiler.compile(ConstraintSpec("regex", r"(yes|no|maybe), because [a-z ]{5,30}\\."))
    prompt = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198]
    rows = [
        dict(params=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), matcher=compiled.new_matcher()),
        dict(params=SamplingParams(temperature=0.9, seed=3), matcher=compiled.new_matcher()),
        dict(params=SamplingParams(temperature=0.7, seed=5, top_p=0.9), matcher=regex.new_matcher()),
        dict(params=SamplingParams(temperature=0.8, seed=11, repetition_penalty=1.3, presence_penalty=0.5),
             stop=(" the",)),
        dict(params=SamplingParams(temperature=0.0, bad_words=((28,), (30, 31))), ignore_eos=True),
        dict(params=SamplingParams(temperature=0.0), prediction_token_ids=[28, 29, 30, 31, 32, 33]),
    ]
    return [GenerationRequest(request_id=f"m{i}", prompt_token_ids=prompt, max_tokens=30 + 7 * i,
                              sink=sink_for(i), eos_token_ids=frozenset({2}), **fields)
            for i, fields in enumerate(rows)]


@pytest.mark.parametrize("slots", [6, 2])
def test_overlap_keeps_every_output_with_constraints_and_features(tiny_hf, default_tokenizer, default_compiler, slots):
    """Same tokens, text, logprobs and finish with the overlapped and the synchronous loop;
    two slots make sequences wait and join mid-flight."""
    results = {}
    for overlap in (False, True):
        engine = Engine(ModelRunner.for_sequences(tiny_hf, slots, 256, block_size=4), default_tokenizer,
                        max_batch_size=slots, max_model_len=256, overlap=overlap, jump_forward=True)
        deltas: dict[int, list] = {}

        def sink_for(i):
            deltas[i] = []
            return deltas[i].append

        for request in mixed_requests(default_compiler, sink_for):
            engine.submit(request)
        run_to_end(engine, deltas)
        engine.flush()
        assert engine.stats.forced_tokens > 0 and engine.stats.draft_tokens > 0
        outputs = {i: ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds), ds[-1].finish_reason,
                       ds[-1].error) for i, ds in deltas.items()}
        results[overlap] = outputs, logprob_values(deltas)
    assert results[True][0] == results[False][0]
    assert_same_logprobs(results[True][1], results[False][1])
    assert all(r[2] in ("stop", "length") for r in results[True][0].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_step_syncs_at_most_once(tiny_model_dir, default_tokenizer):
    """Under torch's sync debug mode, a plain decode step makes at most one synchronizing call
    (the synchronous loop's read of the sampled ids; the overlapped loop waits on an event)."""
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cuda"))
    for overlap in (False, True):
        engine = make_engine(hf, default_tokenizer, overlap=overlap)
        deltas: dict[int, list] = {}
        submit(engine, deltas)
        for _ in range(2):  # prefill, then the first decode step builds the sampler's plan
            engine.step()
        syncs = []
        for _ in range(2):  # every row still decoding (the shortest runs 4 tokens)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        assert all(count <= 1 for count in syncs)
        run_to_end(engine, deltas)
