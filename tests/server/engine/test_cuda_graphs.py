"""GraphedRunner: bucketing, padding (checked on the CPU by running padded batches eagerly), fallbacks,
and CUDA-graph capture/replay (CUDA only)."""

from __future__ import annotations

import copy

import pytest
import torch

from server.engine.cuda_graphs import DecodeInputs, GraphedRunner, bucket_for, decode_buckets, graph_decode_steps
from server.engine.step_batch import StepBatch
from tests.server.engine.paged_llama import PagedLlama

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 9, [100, 101], [3, 1, 4, 1, 5, 9]]
TABLES = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13]]  # block 0 is the null block
NEXT = [11, 12, 13, 14, 15]


class Recorder:
    """Forwards to a runner and records the row count of every batch it ran."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.rows: list[int] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        self.rows.append(batch.num_rows)
        return self.runner.forward(batch)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prefilled(hf_model, attention: str = "reference") -> PagedLlama:
    """A paged runner on the model's device whose cache holds every prompt (one mixed prefill step)."""
    runner = PagedLlama(hf_model, num_blocks=16, block_size=BLOCK_SIZE, attention=attention)
    rows = [(table, prompt, 0) for table, prompt in zip(TABLES, PROMPTS)]
    runner.forward(StepBatch.build(rows, BLOCK_SIZE, runner.device))
    return runner


def decode_batch(count: int, device) -> StepBatch:
    rows = [(TABLES[i], [NEXT[i]], len(PROMPTS[i])) for i in range(count)]
    return StepBatch.build(rows, BLOCK_SIZE, torch.device(device))


def hf_last_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        ids = torch.tensor([tokens], device=hf_model.device)
        return hf_model(ids).logits[0, -1].float()


def test_buckets_are_powers_of_two_then_multiples_of_eight_up_to_the_batch():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert decode_buckets(256)[-3:] == (240, 248, 256)
    assert decode_buckets(1024)[-1] == 512 and decode_buckets(40, max_graph_batch=20)[-1] == 20
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_bucket_for_picks_the_smallest_that_holds_the_rows():
    buckets = decode_buckets(32)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 9, 17, 24, 25, 32)] == [1, 2, 4, 8, 16, 24, 24, 32, 32]
    assert bucket_for(0, buckets) is None
    assert bucket_for(33, buckets) is None


def test_fill_copies_real_rows_and_resets_the_rest_of_the_bucket_to_the_null_block():
    inputs = DecodeInputs(max_rows=8, max_blocks_per_seq=4, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    inputs.fill(decode_batch(3, "cpu"), bucket=4)
    assert inputs.tokens[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [5, 3, 9, 0]
    assert inputs.slot_mapping[:4].tolist() == [2 * BLOCK_SIZE + 1, 4 * BLOCK_SIZE + 3, 8 * BLOCK_SIZE + 1, 0]
    assert inputs.context_lens[:4].tolist() == [6, 4, 10, 1]
    assert inputs.block_tables[:4].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [0, 0, 0, 0]]
    inputs.fill(decode_batch(1, "cpu"), bucket=4)  # rows 1..3 held real rows a step ago
    assert inputs.tokens[:4].tolist() == [11, 0, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [2 * BLOCK_SIZE + 1, 0, 0, 0]
    assert inputs.context_lens[:4].tolist() == [6, 1, 1, 1]
    assert inputs.block_tables[1:4].tolist() == [[0] * 4] * 3
    assert inputs.query_start[:5].tolist() == [0, 1, 2, 3, 4]


def test_paged_test_runner_matches_transformers(hf_model):
    """The test runner is a faithful oracle: its prefill and decode logits equal transformers'."""
    runner = prefilled(hf_model)
    logits = runner.forward(decode_batch(len(PROMPTS), "cpu"))
    for row, prompt in enumerate(PROMPTS):
        expected = hf_last_logits(hf_model, prompt + [NEXT[row]])
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_padded_decode_gives_the_unpadded_logits_and_touches_only_the_null_block(hf_model, rows):
    runner = prefilled(hf_model)
    batch = decode_batch(rows, "cpu")
    expected = runner.forward(batch)
    cache_after_unpadded = runner.kv.k.clone(), runner.kv.v.clone()
    recorder = Recorder(runner)
    graphed = GraphedRunner(recorder, max_batch_size=8, max_blocks_per_seq=6, pad_eagerly=True)

    logits = graphed.forward(batch)

    assert recorder.rows == [bucket_for(rows, graphed.buckets)]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert graphed.last_hidden.shape[0] == rows
    torch.testing.assert_close(runner.kv.k[:, 1:], cache_after_unpadded[0][:, 1:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(runner.kv.v[:, 1:], cache_after_unpadded[1][:, 1:], atol=1e-6, rtol=1e-6)


def test_everything_but_a_plain_decode_runs_unpadded(hf_model):
    runner = prefilled(hf_model)
    recorder = Recorder(runner)
    graphed = GraphedRunner(recorder, max_batch_size=2, max_blocks_per_seq=6, pad_eagerly=True)
    extend = StepBatch.build([(TABLES[0], [11, 12], 5), (TABLES[1], [13], 3)], BLOCK_SIZE, runner.device)
    graphed.forward(extend)  # a two-token row
    scored = StepBatch.build([(TABLES[1], [13], 3)], BLOCK_SIZE, runner.device, logit_counts=[1])
    graphed.forward(scored)  # one logits row per row: still a plain decode, bucket 1
    graphed.forward(decode_batch(3, "cpu"))  # more rows than the largest bucket
    wide = GraphedRunner(recorder, max_batch_size=8, max_blocks_per_seq=2, pad_eagerly=True)
    wide.forward(decode_batch(3, "cpu"))  # a block table wider than the static one
    eager = GraphedRunner(recorder, max_batch_size=8, max_blocks_per_seq=6, enforce_eager=True, pad_eagerly=True)
    eager.forward(decode_batch(3, "cpu"))
    assert recorder.rows == [2, 1, 3, 3, 3]
    assert eager.last_hidden.shape[0] == 3


def test_graph_decode_steps_sizes_the_block_tables_from_the_context_length(hf_model):
    runner = prefilled(hf_model)
    graphed = graph_decode_steps(runner, max_batch_size=16, max_model_len=4 * BLOCK_SIZE + 1)
    assert graphed.buckets == (1, 2, 4, 8, 16) and graphed.inputs.block_tables.shape == (16, 5)
    assert graphed.captured == ()  # the CPU: nothing captured, every step eager


def test_interface_attributes_are_the_runners(hf_model):
    runner = prefilled(hf_model)
    graphed = GraphedRunner(runner, max_batch_size=4, max_blocks_per_seq=6)
    assert (graphed.device, graphed.dtype, graphed.vocab_size, graphed.block_size, graphed.kv) == (
        runner.device, runner.dtype, runner.vocab_size, runner.block_size, runner.kv)
    graphed.capture()  # not CUDA: nothing to capture, forward stays eager
    assert graphed.captured == ()
    torch.testing.assert_close(graphed.forward(decode_batch(2, "cpu")), runner.forward(decode_batch(2, "cpu")))


class ReplayByRerun:
    """A stand-in for a CUDA graph: replay re-runs the captured function (inputs read by address
    from the same static buffers), so the capture bookkeeping is checked on the CPU."""

    def __init__(self, run) -> None:
        self.run = run

    def replay(self) -> None:
        self.run()


def test_captured_replays_give_the_eager_logits_with_a_stand_in_graph(hf_model):
    runner = prefilled(hf_model, attention="dense_decode")  # lengths from tensors, as a graph needs
    pools: list[object] = []

    def factory(run, pool):
        pools.append(pool)
        run()  # a capture runs the function once
        return ReplayByRerun(run), pool or "the pool"

    recorder = Recorder(runner)
    graphed = GraphedRunner(recorder, max_batch_size=8, max_blocks_per_seq=6, graph_factory=factory)
    graphed.capture(sampling=False)  # the decode graphs alone (sampling: test_sampler_graphs)
    assert graphed.captured == (1, 2, 4, 8)
    assert recorder.rows[::3] == [8, 4, 2, 1]  # largest first: two warm-up runs and the capture each
    assert pools == [None, "the pool", "the pool", "the pool"]  # one pool, started by the largest
    for rows in (3, 5, 1, 3):
        batch = decode_batch(rows, "cpu")
        logits = graphed.forward(batch).clone()
        hidden = graphed.last_hidden.clone()
        torch.testing.assert_close(logits, runner.forward(batch), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden, runner.last_hidden, atol=1e-5, rtol=1e-5)
    for row in range(5):
        expected = hf_last_logits(hf_model, PROMPTS[row] + [NEXT[row]])
        torch.testing.assert_close(graphed.forward(decode_batch(5, "cpu"))[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_graphs_give_the_eager_logits_on_cuda(hf_model):
    cuda_model = copy.deepcopy(hf_model).to("cuda")
    runner = prefilled(cuda_model, attention="dense_decode")
    graphed = GraphedRunner(runner, max_batch_size=8, max_blocks_per_seq=6)
    graphed.capture()
    assert graphed.captured == graphed.buckets
    for rows in (3, 5, 1, 3):  # replays of different buckets, and the same bucket twice
        batch = decode_batch(rows, "cuda")
        logits = graphed.forward(batch).clone()
        hidden = graphed.last_hidden.clone()
        expected = runner.forward(batch)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden, runner.last_hidden, atol=1e-4, rtol=1e-4)
    for row in range(5):  # and the graph wrote the same cache the eager forward would
        expected = hf_last_logits(cuda_model, PROMPTS[row] + [NEXT[row]])
        torch.testing.assert_close(graphed.forward(decode_batch(5, "cuda"))[row], expected, atol=1e-3, rtol=1e-3)
