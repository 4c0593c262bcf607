"""The sampling pass in graphs: capture bookkeeping and replays on the CPU (a stand-in "graph"
re-runs the captured function on replay), the engine over it (same greedy tokens as the eager
engine with json_schema rows), the fallback to the eager sampler, and a real capture on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import Sampler, SamplingParams
from sampler.graphable import VARIANTS
from server.engine.admission import WaitAdmission
from server.engine.cuda_graphs import GraphedRunner, decode_buckets
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sampler_graphs import SamplerGraphs
from server.engine.sequence import GenerationRequest
from server.state import ServerState
from tests.server.engine.test_cuda_graphs import decode_batch, prefilled as prefilled_paged
from tests.server.engine.test_piecewise import BLOCK, MAX_LEN, SCHEMA, Factory

V = 500


def words(allowed_ranges: list[tuple[int, int]], device) -> torch.Tensor:
    """[R, W] int32 bitmask allowing lo..hi-1 per row."""
    out = torch.zeros(len(allowed_ranges), (V + 31) // 32, dtype=torch.int64)
    for row, (lo, hi) in enumerate(allowed_ranges):
        for token in range(lo, hi):
            out[row, token // 32] |= 1 << (token % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).to(device)


def captured_graphs(device="cpu", max_rows: int = 8) -> tuple[SamplerGraphs, Factory]:
    graphs, factory = SamplerGraphs(V, decode_buckets(max_rows), torch.device(device)), Factory()
    graphs.capture(factory, None, lambda run: run())
    return graphs, factory


def test_every_bucket_and_variant_is_captured_largest_first_in_one_pool():
    graphs, factory = captured_graphs()
    assert graphs.captured == (1, 2, 4, 8) and graphs.num_graphs == 4 * len(VARIANTS)
    assert factory.pools == [None] + ["the pool"] * (graphs.num_graphs - 1)
    assert graphs.bucket(3) == 4 and graphs.bucket(9) is None and graphs.bucket(0) is None


def test_replays_give_the_eager_greedy_tokens_and_logprobs():
    graphs, _ = captured_graphs()
    sampler = Sampler(V, "cpu")
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=4), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0, logprobs=True)]
    rows = [sampler.new_row(p, [1, 2]) for p in params]
    gen = torch.Generator().manual_seed(5)
    for count in (4, 1, 3, 4):  # buckets 4, 1, 4 (three rows), 4
        logits = torch.randn(count, V, generator=gen) * 3
        bitmask, indices = words([(100, 140)], "cpu"), torch.tensor([count - 1])
        got = graphs.sample(logits.clone(), rows[:count], bitmask, indices)
        expected = sampler.sample(logits.clone(), rows[:count], bitmask, indices)
        greedy = [i for i in range(count) if params[i].greedy]
        assert [got.token_ids[i] for i in greedy] == [expected.token_ids[i] for i in greedy]
        assert [got.logprobs[i] for i in greedy] == [expected.logprobs[i] for i in greedy]
        assert 100 <= got.token_ids[count - 1] < 140


def test_a_step_the_pass_cannot_take_is_declined_untouched():
    graphs, _ = captured_graphs()
    sampler = Sampler(V, "cpu")
    seeded = [sampler.new_row(SamplingParams(temperature=0), []), sampler.new_row(SamplingParams(seed=1), [])]
    before = graphs.static.params.clone()
    assert graphs.sample(torch.randn(2, V), seeded) is None
    assert torch.equal(graphs.static.params, before)
    many = [sampler.new_row(SamplingParams(temperature=0), []) for _ in range(9)]
    assert graphs.sample(torch.randn(9, V), many) is None  # beyond the largest bucket
    uncaptured = SamplerGraphs(V, (1, 2), torch.device("cpu"))
    assert uncaptured.sample(torch.randn(1, V), many[:1]) is None  # nothing captured: eager


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_replayed_decode_logits_are_sampled_in_place_from_the_graphs_buffer(hf_model):
    runner = prefilled_paged(hf_model, attention="dense_decode")  # lengths from tensors, as a graph needs
    graphed = GraphedRunner(runner, max_batch_size=8, max_blocks_per_seq=6, graph_factory=Factory())
    graphed.capture(pieces=False)
    sampling = graphed.graph_sampler
    assert sampling.captured == (1, 2, 4, 8)
    assert sampling.static.logits.data_ptr() == graphed._logits.data_ptr()  # shared: no copy per step
    sampler = Sampler(runner.vocab_size, "cpu")
    rows = [sampler.new_row(SamplingParams(temperature=0, logprobs=True, top_logprobs=2), [1]) for _ in range(5)]
    logits = graphed.forward(decode_batch(5, "cpu"))
    expected = sampler.sample(logits.clone(), rows)
    assert sampling.sample(logits, rows) == expected


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def generate(engine: Engine, compiler, tokenizer, extra: SamplingParams | None = None) -> list[list[int]]:
    """Two json_schema requests (jump-forward) and a free one, greedy with logprobs, submitted
    together; ``extra`` adds a free request with those parameters."""
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)] * 3 + ([extra] if extra else [])
    results: list[list[int]] = [[] for _ in params]
    finished = [False for _ in params]

    def sink_for(i):
        def sink(delta):
            results[i] += delta.token_ids
            finished[i] = finished[i] or bool(delta.finish_reason)
        return sink

    texts = ("A person as JSON:", "Another one, JSON please", "Hello there", "Once upon a time")
    for i, p in enumerate(params):
        matcher = compiler.compile(ConstraintSpec("json_schema", SCHEMA)).new_matcher() if i < 2 else None
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt_token_ids=tokenizer.encode(texts[i]), max_tokens=16,
                                        sink=sink_for(i), params=p, matcher=matcher,
                                        eos_token_ids=frozenset({tokenizer.eos_token_id})))
    for _ in range(500):
        if all(finished):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


def graphed_engine(tiny_hf, tokenizer, overlap: bool | None = None) -> tuple[Engine, GraphedRunner]:
    runner = ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK)
    graphed = GraphedRunner(runner, max_batch_size=4, max_blocks_per_seq=2 * MAX_LEN // BLOCK,
                            max_graph_tokens=32, pad_eagerly=True, graph_factory=Factory())
    graphed.capture(decode=False)  # decode steps pad eagerly (the CPU attention reads host lengths)
    return Engine(graphed, tokenizer, max_batch_size=4, max_model_len=MAX_LEN * 2, overlap=overlap,
                  speculation=False), graphed


@pytest.fixture(scope="module")
def compiler(tiny_hf, default_tokenizer):
    compiler = ConstraintCompiler(default_tokenizer, tiny_hf.config.vocab_size,
                                  stop_token_ids=[default_tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def test_engine_samples_in_graph_and_gives_the_eager_tokens(tiny_hf, default_tokenizer, compiler):
    eager = Engine(ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK), default_tokenizer,
                   max_batch_size=4, max_model_len=MAX_LEN * 2, speculation=False)
    expected = generate(eager, compiler, default_tokenizer)
    engine, graphed = graphed_engine(tiny_hf, default_tokenizer)
    assert graphed.graph_sampler.captured == (1, 2, 4)
    assert generate(engine, compiler, default_tokenizer) == expected
    assert eager.stats.sampled_in_graph == 0 and eager.stats.sampled_eagerly > 0
    assert engine.stats.forced_tokens == eager.stats.forced_tokens > 0  # jump-forward steps were sampled too
    assert engine.stats.sampled_in_graph == eager.stats.sampled_eagerly and engine.stats.sampled_eagerly == 0
    gauges = ServerState._engine_gauges(SimpleNamespace(engine=engine, compiler=None, queue_wait=_no_wait_limit(engine)))  # what /metrics shows
    assert gauges["trellis_sampler_passes_in_graph"][1] == engine.stats.sampled_in_graph
    assert gauges["trellis_sampler_passes_eager"][1] == 0


def test_overlapped_engine_samples_in_graph_and_gives_the_eager_tokens(tiny_hf, default_tokenizer, compiler):
    """The CUDA path's overlapped loop: ids out of the sampling graph's buffer feed the next
    step from the device, logprobs read back packed, the same tokens as the eager sampler's."""
    eager = Engine(ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK), default_tokenizer,
                   max_batch_size=4, max_model_len=MAX_LEN * 2, speculation=False)
    expected = generate(eager, compiler, default_tokenizer)
    engine, _ = graphed_engine(tiny_hf, default_tokenizer, overlap=True)
    assert generate(engine, compiler, default_tokenizer) == expected
    assert engine.stats.sampled_in_graph > 0 and engine.stats.sampled_eagerly == 0
    assert engine.stats.overlapped_steps > 0


def test_engine_samples_eagerly_while_a_row_needs_the_eager_sampler(tiny_hf, default_tokenizer, compiler):
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    eager = Engine(ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK), default_tokenizer,
                   max_batch_size=4, max_model_len=MAX_LEN * 2, speculation=False)
    expected = generate(eager, compiler, default_tokenizer, penalised)
    engine, _ = graphed_engine(tiny_hf, default_tokenizer)
    assert generate(engine, compiler, default_tokenizer, penalised) == expected
    assert engine.stats.sampled_eagerly > 0  # every step with the penalised row in it
    total = engine.stats.sampled_eagerly + engine.stats.sampled_in_graph
    assert total == eager.stats.sampled_eagerly


# ---------------------------------------------------------------- a real capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_sampling_graphs_on_cuda():
    from server.engine.cuda_graphs import capture_cuda_graph

    device = torch.device("cuda")
    graphs = SamplerGraphs(V, decode_buckets(8), device)

    def warm_up(run):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    graphs.capture(capture_cuda_graph, None, warm_up)
    assert graphs.captured == (1, 2, 4, 8)
    sampler = Sampler(V, device)
    greedy = [sampler.new_row(SamplingParams(temperature=0, logprobs=True, top_logprobs=3), [1]) for _ in range(3)]
    for _ in range(3):
        logits = torch.randn(3, V, device=device) * 3
        bitmask, indices = words([(10, 30)], device), torch.tensor([1], device=device)
        got = graphs.sample(logits.clone(), greedy, bitmask, indices)
        expected = sampler.sample(logits.clone(), greedy, bitmask, indices)
        assert got.token_ids == expected.token_ids and 10 <= got.token_ids[1] < 30
        for a, b in zip(got.logprobs, expected.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    rows = [sampler.new_row(SamplingParams(temperature=1.0, top_p=0.95), [1]) for _ in range(8)]
    flat = torch.zeros(8, V, device=device)
    draws = [graphs.sample(flat.clone(), rows, words([(0, 250)], device), torch.tensor([0], device=device)).token_ids
             for _ in range(4)]
    assert len(set(map(tuple, draws))) == 4  # every replay draws new numbers
    assert all(token < 250 for token in (d[0] for d in draws))


def _no_wait_limit(engine: Engine) -> WaitAdmission:
    """The server's queue-wait admission over ``engine``, without a limit (its gauge reads it)."""
    return WaitAdmission(engine.admission, 0, engine.max_batch_size, lambda: engine.num_running)
