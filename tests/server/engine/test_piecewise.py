"""Piecewise graphs of mixed steps: the piece bookkeeping on the CPU (a stand-in "graph" re-runs the
captured piece on replay), the engine over it with jump-forward, and a real capture on CUDA."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from constraints import ConstraintCompiler, ConstraintSpec
from sampler import SamplingParams
from server.engine.admission import WaitAdmission
from server.engine.cuda_graphs import NULL_BLOCK, GraphedRunner, is_plain_decode
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.piecewise import supports_pieces, token_buckets
from server.engine.sequence import GenerationRequest
from server.engine.step_batch import StepBatch
from server.state import ServerState
from tests.server.engine.paged_llama import PagedLlama
from tests.server.engine.test_cuda_graphs import ReplayByRerun

BLOCK = 4
MAX_LEN = 64
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 9, [100, 101, 102, 103]]


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def table(slot: int) -> list[int]:
    per_seq = -(-MAX_LEN // BLOCK)
    return [1 + slot * per_seq + i for i in range(per_seq)]  # block 0 is the null block


def prefilled(hf, slots: int = 8) -> ModelRunner:
    """A runner whose cache holds every prompt in slots 0..3 (one eager prefill step)."""
    runner = ModelRunner.for_sequences(hf, slots, MAX_LEN, block_size=BLOCK)
    rows = [(table(slot), prompt, 0) for slot, prompt in enumerate(PROMPTS)]
    runner.forward(StepBatch.build(rows, BLOCK, runner.device))
    return runner


class Factory:
    """A graph factory whose graphs re-run the captured function; records the pools it got."""

    def __init__(self) -> None:
        self.pools: list[object] = []

    def __call__(self, run, pool):
        self.pools.append(pool)
        run()  # a capture runs the function once
        return ReplayByRerun(run), pool or "the pool"


def mixed_batches(device) -> list[StepBatch]:
    """Steps that are not plain decodes, of 6 to 32 tokens (buckets 8, 16, 24, 32)."""
    build = lambda rows, **kw: StepBatch.build(rows, BLOCK, torch.device(device), **kw)  # noqa: E731
    return [
        # two decode rows, a prefill chunk of a new sequence, a three-token jump-forward continuation: 12 tokens
        build([(table(0), [11], 5), (table(1), [12], 3), (table(4), [60, 61, 62, 63, 64, 65, 66], 0),
               (table(3), [70, 71, 72], 4)]),
        # a draft verified with per-position logits beside a decode row: 5 tokens, 5 logits rows
        build([(table(0), [13, 14, 15, 16], 6), (table(1), [17], 4)], logit_counts=[4, 1]),
        # the prefill continues (a chunk of 17), a decode row: 18 tokens
        build([(table(4), list(range(200, 217)), 7), (table(2), [18], 9)]),
        # exactly one bucket (24): a scored choice of 8 positions and a 16-token extension
        build([(table(5), list(range(300, 308)), 0), (table(3), list(range(400, 416)), 7)], logit_counts=[8, 1]),
        # the largest bucket, full: 32 tokens in one row, per-position logits at its last 3
        build([(table(6), list(range(500, 532)), 0)], logit_counts=[3]),
        # a plain decode with no decode graph (none captured here) takes the pieces too
        build([(table(0), [19], 10), (table(1), [20], 5)]),
    ]


def graphed_pieces(hf, **kwargs) -> tuple[GraphedRunner, Factory]:
    factory = Factory()
    graphed = GraphedRunner(prefilled(hf), max_batch_size=4, max_blocks_per_seq=MAX_LEN // BLOCK,
                            max_graph_tokens=32, graph_factory=factory, **kwargs)
    graphed.capture(decode=False, sampling=False)  # the pieces alone
    return graphed, factory


def test_token_buckets_step_by_8_16_32_64_up_to_the_largest():
    assert token_buckets(512) == (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    assert token_buckets(32) == (8, 16, 24, 32)
    assert token_buckets(40) == (8, 16, 24, 32, 40)
    assert token_buckets(5) == (5,)
    assert token_buckets(0) == ()


def test_pieces_are_captured_per_bucket_largest_first_in_one_pool(tiny_hf):
    graphed, factory = graphed_pieces(tiny_hf)
    layers = tiny_hf.config.num_hidden_layers
    assert graphed.captured == ()  # decode graphs skipped here
    assert graphed.captured_token_buckets == (8, 16, 24, 32)
    assert graphed.pieces.num_graphs == 4 * (layers + 1)
    assert factory.pools == [None] + ["the pool"] * (4 * (layers + 1) - 1)


def test_mixed_steps_through_the_pieces_give_the_eager_logits_and_cache(tiny_hf):
    eager = prefilled(tiny_hf)
    graphed, _ = graphed_pieces(tiny_hf)
    for batch in mixed_batches("cpu"):
        expected = eager.forward(batch)
        logits = graphed.forward(batch)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.last_hidden, eager.last_hidden, atol=1e-5, rtol=1e-5)
        # padding writes no key/value anywhere: the whole cache is what eager wrote, the null block untouched
        torch.testing.assert_close(graphed.kv.k, eager.kv.k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(graphed.kv.v, eager.kv.v, atol=1e-6, rtol=1e-6)
        assert not graphed.kv.k[:, 0].any() and not graphed.kv.v[:, 0].any()
    assert graphed.path_counts == {"full_graph": 0, "piecewise": 6, "eager": 0}


def test_what_the_pieces_do_not_take_runs_eagerly(tiny_hf):
    graphed, _ = graphed_pieces(tiny_hf)
    eager = prefilled(tiny_hf)
    too_long = StepBatch.build([(table(6), list(range(600, 633)), 0)], BLOCK, eager.device)  # 33 > 32 tokens
    torch.testing.assert_close(graphed.forward(too_long), eager.forward(too_long), atol=1e-5, rtol=1e-5)
    assert graphed.path_counts == {"full_graph": 0, "piecewise": 0, "eager": 1}
    lora = StepBatch.build([(table(0), [11, 12], 5)], BLOCK, eager.device, row_adapters=[1])
    assert graphed.pieces.bucket(lora) is None  # LoRA steps stay eager
    forced_eager = GraphedRunner(eager, max_batch_size=4, max_blocks_per_seq=16, enforce_eager=True,
                                 graph_factory=Factory())
    assert forced_eager.pieces is None and not forced_eager.uses_graphs
    assert supports_pieces(eager) and not supports_pieces(PagedLlama(tiny_hf, num_blocks=4, block_size=BLOCK))
    on_cpu = GraphedRunner(eager, max_batch_size=4, max_blocks_per_seq=16)  # no factory, not CUDA: nothing graphed
    assert on_cpu.pieces is None


def test_pad_eagerly_runs_the_pieces_on_the_buffers_without_graphs(tiny_hf):
    eager = prefilled(tiny_hf)
    graphed = GraphedRunner(prefilled(tiny_hf), max_batch_size=4, max_blocks_per_seq=16, max_graph_tokens=32,
                            pad_eagerly=True)
    for batch in mixed_batches("cpu")[:3]:
        torch.testing.assert_close(graphed.forward(batch), eager.forward(batch), atol=1e-5, rtol=1e-5)
    assert graphed.path_counts["piecewise"] == 3 and graphed.captured_token_buckets == ()


# ---------------------------------------------------------------- the engine over the pieces

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def generate(engine: Engine, compiler, tokenizer) -> list[list[int]]:
    """Two json_schema requests (jump-forward) and a free one, greedy, submitted together."""
    results: list[list[int]] = [[], [], []]
    finished = [False, False, False]

    def sink_for(i):
        def sink(delta):
            results[i] += delta.token_ids
            finished[i] = finished[i] or bool(delta.finish_reason)
        return sink

    prompts = [tokenizer.encode(text) for text in ("A person as JSON:", "Another one, JSON please", "Hello there")]
    for i, prompt in enumerate(prompts):
        matcher = compiler.compile(ConstraintSpec("json_schema", SCHEMA)).new_matcher() if i < 2 else None
        engine.submit(GenerationRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=32, sink=sink_for(i),
                                        params=SamplingParams(temperature=0.0), matcher=matcher,
                                        eos_token_ids=frozenset({tokenizer.eos_token_id})))
    for _ in range(500):
        if all(finished):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_over_the_pieces_generates_the_eager_tokens_with_jump_forward(tiny_hf, default_tokenizer, overlap):
    compiler = ConstraintCompiler(default_tokenizer, tiny_hf.config.vocab_size,
                                  stop_token_ids=[default_tokenizer.eos_token_id])
    try:
        eager = Engine(ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK), default_tokenizer,
                       max_batch_size=4, max_model_len=MAX_LEN * 2)
        expected = generate(eager, compiler, default_tokenizer)
        runner = ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN * 2, block_size=BLOCK)
        graphed = GraphedRunner(runner, max_batch_size=4, max_blocks_per_seq=2 * MAX_LEN // BLOCK,
                                max_graph_tokens=64, pad_eagerly=True, graph_factory=Factory())
        graphed.capture(decode=False)  # decode steps pad eagerly: the CPU attention reads host lengths
        mixed = []
        forward = graphed.forward
        graphed.forward = lambda batch: (mixed.append(not is_plain_decode(batch)), forward(batch))[1]
        engine = Engine(graphed, default_tokenizer, max_batch_size=4, max_model_len=MAX_LEN * 2, overlap=overlap)
        assert generate(engine, compiler, default_tokenizer) == expected
    finally:
        compiler.close()
    assert eager.stats.forced_tokens > 0 and engine.stats.forced_tokens == eager.stats.forced_tokens
    assert sum(mixed) > 1  # the prefill and the jump-forward steps
    assert graphed.path_counts == {"full_graph": len(mixed) - sum(mixed), "piecewise": sum(mixed), "eager": 0}
    gauges = ServerState._engine_gauges(SimpleNamespace(engine=engine, compiler=None, queue_wait=_no_wait_limit(engine)))  # what /metrics shows
    assert gauges["trellis_forward_steps_piecewise"][1] == sum(mixed)
    assert gauges["trellis_forward_steps_eager"][1] == 0


# ---------------------------------------------------------------- a real capture

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_pieces_give_the_eager_logits_on_cuda(tiny_hf):
    cuda_hf = copy.deepcopy(tiny_hf).to("cuda")
    eager = prefilled(cuda_hf)
    graphed = GraphedRunner(prefilled(cuda_hf), max_batch_size=4, max_blocks_per_seq=MAX_LEN // BLOCK,
                            max_graph_tokens=32)
    graphed.capture()
    assert graphed.captured_token_buckets == (8, 16, 24, 32)
    for batch in mixed_batches("cuda")[:5]:  # the last one is a plain decode: its full graph
        expected = eager.forward(batch)
        torch.testing.assert_close(graphed.forward(batch), expected, atol=1e-4, rtol=1e-4)
        # every block but the null one: a padded graph's filler tokens write there, eager has none
        owned = slice(NULL_BLOCK + 1, None)
        torch.testing.assert_close(graphed.kv.k[:, owned], eager.kv.k[:, owned], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(graphed.kv.v[:, owned], eager.kv.v[:, owned], atol=1e-4, rtol=1e-4)
    assert graphed.path_counts == {"full_graph": 0, "piecewise": 5, "eager": 0}


def _no_wait_limit(engine: Engine) -> WaitAdmission:
    """The server's queue-wait admission over ``engine``, without a limit (its gauge reads it)."""
    return WaitAdmission(engine.admission, 0, engine.max_batch_size, lambda: engine.num_running)
