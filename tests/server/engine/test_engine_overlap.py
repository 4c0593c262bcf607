"""Host/device overlap in the engine step: deltas delivered after the next forward launch give
the same deltas as delivering at once (CPU), and on CUDA a decode step reads the device back
exactly once."""

from __future__ import annotations

import warnings

import pytest
import torch

from sampler import SamplingParams
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest

PROMPTS = [[1, 504, 3300, 28, 1012], [1, 77, 88, 99], [1, 2500, 314, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def make_engine(hf, tokenizer, **kwargs) -> Engine:
    runner = ModelRunner.for_sequences(hf, 4, 128, block_size=4)
    return Engine(runner, tokenizer, max_batch_size=4, max_model_len=128, **kwargs)


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
    return {i: [(d.token_ids, d.text, d.finish_reason, d.error, d.logprobs, d.completion_tokens) for d in ds]
            for i, ds in deltas.items()}


def test_deferred_delivery_gives_the_same_deltas(tiny_hf, default_tokenizer):
    results = {}
    for overlap in (False, True):
        engine = make_engine(tiny_hf, default_tokenizer, overlap_delivery=overlap)
        deltas: dict[int, list] = {}
        submit(engine, deltas)
        run_to_end(engine, deltas)
        assert not engine._deferred and not engine.scheduler.running
        results[overlap] = summary(deltas)
    assert results[True] == results[False]
    assert [len(ds) for ds in results[True].values()] == [9, 4, 6]  # one delta per sampled token


def test_a_steps_deltas_go_out_during_the_next_step(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, overlap_delivery=True)
    deltas: dict[int, list] = {}
    submit(engine, deltas)
    engine.step()  # prefill and first tokens: held back while the sequences run on
    assert [len(d) for d in deltas.values()] == [0, 0, 0]
    engine.step()  # delivered after this step's forward launch
    assert [len(d) for d in deltas.values()] == [1, 1, 1]
    run_to_end(engine, deltas)  # the last step delivers at once: nothing is left behind
    assert all(d[-1].finish_reason == "length" for d in deltas.values())


def test_a_failing_deferred_sink_fails_only_its_sequence(tiny_hf, default_tokenizer):
    engine = make_engine(tiny_hf, default_tokenizer, overlap_delivery=True)
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
    assert make_engine(tiny_hf, default_tokenizer).overlap_delivery is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_step_syncs_once(tiny_model_dir, default_tokenizer):
    """Under torch's sync debug mode, every plain decode step (greedy and sampled rows, logprobs
    with top alternatives) makes exactly one synchronizing call: reading the sampled ids back."""
    hf = load_hf_model(tiny_model_dir, torch.float32, torch.device("cuda"))
    engine = make_engine(hf, default_tokenizer)
    assert engine.overlap_delivery
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
    assert syncs == [1, 1]
    run_to_end(engine, deltas)
