"""Decode steps replayed from CUDA graphs captured at start-up, at bucketed batch sizes.

A decode step of a small model is mostly kernel-launch overhead on a GPU (the 1B shape spent
~85% of its batch-1 step launching kernels). :class:`GraphedRunner` wraps a paged model runner:
a decode-only batch (every row one new token, one logits row per row, no LoRA) of ``R`` rows
is padded to the smallest bucket ``B >= R`` (1, 2, 4, 8, 16, 24, 32, … up to the largest
batch, at most 512), its inputs are copied into static buffers and the graph captured for ``B``
is replayed. A mixed step (prefill chunks, jump-forward continuations, drafts, per-position
logits) of at most 512 tokens on the base model replays piecewise graphs instead: everything but
attention captured per token bucket, attention eager between the pieces
(:mod:`server.engine.piecewise`; only runners exposing the piece functions, i.e.
:class:`~server.engine.model.ModelRunner`). Everything else (LoRA, larger mixed steps, a CPU
device, ``--enforce-eager``, the transformers runner's mixed steps) runs the wrapped runner
eagerly. :attr:`GraphedRunner.path_counts` counts the steps each path took.

The sampling pass of a step whose rows all qualify (no seed, penalty, logit_bias, bad words,
client processor or device DFA; see :mod:`sampler.graphable`) replays graphs too, captured per
row bucket up to 256 rows (:attr:`GraphedRunner.graph_sampler`, :mod:`server.engine.sampler_graphs`);
the engine falls back to the eager sampler for every other step.

Padding rows feed token 0 at position 0, write their key/value into slot 0 of block 0 (the
block manager's scratch "null" block that no sequence owns) and attend over that one slot; their
logits are computed and dropped. They never touch a real row's blocks, and rows do not interact
outside attention, so the real rows' logits are those of the unpadded batch.

The graph path's :class:`PagedAttentionMetadata` is built once per bucket from the static
tensors. Its host lists (``query_lens_host``, ``context_lens_host``) are fixed when the graph is
captured and are NOT the replayed batch's lengths: every query length is 1 and every context
length is the most a row can hold (``max_blocks_per_seq * block_size``), so anything sized
from them at capture covers every later replay. A graph-captured attention must read lengths
only from the tensors (``context_lens``, ``block_tables``), never from the host lists.

Capture follows the usual recipe (PyTorch's CUDA-graph notes; nano-vllm and vLLM do the same):
warm each bucket up eagerly on a side stream, capture the largest bucket first so one memory
pool sized by it serves every smaller graph, and copy each graph's outputs into buffers shared
by all graphs so nothing but the pool outlives a capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from kernels.paged_attention import PagedAttentionMetadata
from server.engine.piecewise import MAX_GRAPH_TOKENS, PiecewiseGraphs, supports_pieces
from server.engine.sampler_graphs import MAX_GRAPH_SAMPLE_ROWS, SamplerGraphs
from server.engine.step_batch import StepBatch

log = logging.getLogger("trellis.engine")

NULL_BLOCK = 0  # the block manager's scratch block: padding rows write and read only its slot 0
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8  # above 8 rows: 16, 24, 32, … (vLLM and SGLang pad decode batches the same way)
MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: eager costs them little, capture a lot
WARMUP_STEPS = 2


def decode_buckets(max_batch_size: int, max_graph_batch: int = MAX_GRAPH_BATCH) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 8 from 16, up to
    ``max_batch_size`` (always included, so every batch the engine can form has a bucket) or
    ``max_graph_batch``, whichever is smaller."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    largest = min(max_batch_size, max_graph_batch)
    sizes = [size for size in SMALL_BUCKETS if size <= largest]
    sizes += range(2 * BUCKET_STEP, largest + 1, BUCKET_STEP)
    if sizes[-1] != largest:
        sizes.append(largest)
    return tuple(sizes)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows; None when ``rows`` is 0 or beyond the largest."""
    if rows < 1:
        return None
    index = bisect.bisect_left(buckets, rows)
    return buckets[index] if index < len(buckets) else None


def is_plain_decode(batch: StepBatch) -> bool:
    """Every row feeds one token and gets one logits row, all on the base model, from token ids."""
    single_logits = batch.logit_counts is None or all(count == 1 for count in batch.logit_counts)
    return (batch.num_rows > 0 and batch.all_single and single_logits and batch.lora is None
            and batch.media is None)


class DecodeInputs:
    """Static decode-step inputs for up to ``max_rows`` rows; a graph reads them by address.

    :meth:`fill` copies a batch's rows into the first ``R`` entries and resets rows ``R..B`` of
    the bucket to padding (token 0 at position 0, slot 0 of the null block, context length 1).
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self._ints = torch.zeros((3, max_rows), dtype=torch.long, device=device)  # one zero_() pads all three
        self.tokens, self.positions, self.slot_mapping = self._ints[0], self._ints[1], self._ints[2]
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_rows, max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one query per row
        self.last_index = torch.arange(max_rows, dtype=torch.long, device=device)

    def fits(self, batch: StepBatch) -> bool:
        return batch.num_rows <= self.max_rows and batch.attn.block_tables.shape[1] <= self.max_blocks_per_seq

    def fill(self, batch: StepBatch, bucket: int) -> None:
        """Copy a plain-decode ``batch`` of ``R <= bucket`` rows in and pad rows ``R..bucket``."""
        rows, width = batch.num_rows, batch.attn.block_tables.shape[1]
        self.tokens[:rows].copy_(batch.tokens, non_blocking=True)
        self.positions[:rows].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(batch.attn.slot_mapping, non_blocking=True)
        self.context_lens[:rows].copy_(batch.attn.context_lens, non_blocking=True)
        self.block_tables[:rows, :width].copy_(batch.attn.block_tables, non_blocking=True)
        self.pad(rows, bucket)

    def pad(self, start: int, bucket: int) -> None:
        """Rows ``start..bucket`` become padding rows (the null block's slot 0, one token of context)."""
        if start >= bucket:
            return
        self._ints[:, start:bucket].zero_()  # token 0, position 0, slot 0 (the null block's first slot)
        self.context_lens[start:bucket].fill_(1)
        self.block_tables[start:bucket].fill_(NULL_BLOCK)

    def step_batch(self, bucket: int, context_lens_host: list[int]) -> StepBatch:
        """A :class:`StepBatch` of views of the first ``bucket`` rows (the graph's inputs)."""
        attn = PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start=self.query_start[: bucket + 1],
            context_lens=self.context_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_host=[1] * bucket,
            context_lens_host=context_lens_host,
        )
        return StepBatch(tokens=self.tokens[:bucket], positions=self.positions[:bucket],
                         last_index=self.last_index[:bucket], attn=attn)

    def capture_batch(self, bucket: int) -> StepBatch:
        """The batch a graph is captured with: host lengths fixed at their worst case (see the
        module docstring), every row padding until :meth:`fill` writes real rows."""
        self.pad(0, bucket)
        return self.step_batch(bucket, [self.max_blocks_per_seq * self.block_size] * bucket)

    def padded_batch(self, batch: StepBatch, bucket: int) -> StepBatch:
        """The filled bucket with true host lengths, for running the padded batch eagerly."""
        return self.step_batch(bucket, list(batch.attn.context_lens_host) + [1] * (bucket - batch.num_rows))


class Replayable(Protocol):
    def replay(self) -> None: ...


GraphFactory = Callable[[Callable[[], None], Any], tuple[Replayable, Any]]


def capture_cuda_graph(run: Callable[[], None], pool: Any) -> tuple[Replayable, Any]:
    """Capture ``run`` into a CUDA graph allocating from ``pool`` (None: a new pool); returns
    the graph and the pool for the next capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph, pool if pool is not None else graph.pool()


@dataclass
class _Graph:
    graph: Replayable
    batch: StepBatch  # keeps the captured views (and their host lists) alive


class GraphedRunner:
    """``runner.forward`` with plain decode steps replayed from CUDA graphs and mixed steps from
    piecewise graphs (see the module docstring).

    Same interface as the wrapped runner (``forward``, ``device``, ``dtype``, ``vocab_size``,
    ``block_size``, ``kv``, ``last_hidden``; any other attribute is the runner's). Call
    :meth:`capture` once at start-up, after the KV cache exists and before the engine steps.
    The logits a replay returns are a view of a buffer the next forward overwrites: use them
    (sample) before the next forward, as the engine does.

    Test seams (any device): ``pad_eagerly`` pads plain-decode batches to their bucket exactly as
    for a replay and runs the padded batch eagerly, and runs mixed steps through the piece
    functions on the static buffers without graphs; ``graph_factory`` replaces
    :func:`capture_cuda_graph` (e.g. a "graph" that re-runs the function on replay), so the
    capture bookkeeping is checked on the CPU. With ``pad_eagerly`` :attr:`path_counts` names
    the path a step would have replayed.
    """

    def __init__(self, runner, max_batch_size: int, max_blocks_per_seq: int, enforce_eager: bool = False,
                 *, max_graph_tokens: int = MAX_GRAPH_TOKENS, pad_eagerly: bool = False,
                 graph_factory: GraphFactory | None = None, sample_in_graph: bool = True,
                 max_sample_rows: int = MAX_GRAPH_SAMPLE_ROWS) -> None:
        self.runner = runner
        self.enforce_eager = enforce_eager
        self.pad_eagerly = pad_eagerly and not enforce_eager
        self._on_cuda = runner.device.type == "cuda"
        self._graph_factory = graph_factory or (capture_cuda_graph if self._on_cuda else None)
        self.buckets = decode_buckets(max_batch_size)
        self.inputs = DecodeInputs(self.buckets[-1], max_blocks_per_seq, runner.block_size, runner.device)
        self.pieces: PiecewiseGraphs | None = None
        if (self.uses_graphs or self.pad_eagerly) and max_graph_tokens > 0 and supports_pieces(runner):
            self.pieces = PiecewiseGraphs(runner, max_graph_tokens)
        self.graph_sampler: SamplerGraphs | None = None  # the sampling pass's graphs (None: sample eagerly)
        if (self.uses_graphs or self.pad_eagerly) and sample_in_graph and max_sample_rows > 0:
            self.graph_sampler = SamplerGraphs(runner.vocab_size, decode_buckets(min(max_batch_size, max_sample_rows)),
                                               runner.device, run_uncaptured=self.pad_eagerly)
        self.path_counts = {"full_graph": 0, "piecewise": 0, "eager": 0}  # forward steps by path
        self._graphs: dict[int, _Graph] = {}
        self._captured = False
        self._logits: torch.Tensor | None = None  # [max bucket, V], written by every graph
        self._hidden: torch.Tensor | None = None  # [max bucket, D]
        self._last_hidden: torch.Tensor | None = None

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet (during __init__ or unpickling)
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def last_hidden(self) -> torch.Tensor | None:
        """[R, D] final-norm hidden states of the rows of the last forward."""
        return self._last_hidden

    @property
    def captured(self) -> tuple[int, ...]:
        """The decode buckets that have a graph (empty before :meth:`capture` and off CUDA)."""
        return tuple(sorted(self._graphs))

    @property
    def captured_token_buckets(self) -> tuple[int, ...]:
        """The token buckets that have piece graphs."""
        return self.pieces.captured if self.pieces is not None else ()

    @property
    def uses_graphs(self) -> bool:
        return not self.enforce_eager and self._graph_factory is not None

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits [R, V] (float32) of ``batch``: a full graph for a plain decode, piece graphs
        for a mixed step, eager otherwise."""
        bucket = self._bucket(batch)
        if bucket is not None and (bucket in self._graphs or self.pad_eagerly):
            self.path_counts["full_graph"] += 1
            return self._replay(batch, bucket) if bucket in self._graphs else self._padded_eager(batch, bucket)
        tokens = self._token_bucket(batch)
        if tokens is not None:
            self.path_counts["piecewise"] += 1
            logits = self.pieces.forward(batch, tokens)
            self._last_hidden = self.runner.last_hidden
            return logits
        self.path_counts["eager"] += 1
        logits = self.runner.forward(batch)
        self._last_hidden = self.runner.last_hidden
        return logits

    def _bucket(self, batch: StepBatch) -> int | None:
        if self.enforce_eager or not is_plain_decode(batch) or not self.inputs.fits(batch):
            return None
        return bucket_for(batch.num_rows, self.buckets)

    def _token_bucket(self, batch: StepBatch) -> int | None:
        """The token bucket of a step the piece graphs run (captured, or ``pad_eagerly``)."""
        if self.enforce_eager or self.pieces is None:
            return None
        bucket = self.pieces.bucket(batch)
        if bucket is None or not (self.pad_eagerly or bucket in self.pieces.captured):
            return None
        return bucket

    def _replay(self, batch: StepBatch, bucket: int) -> torch.Tensor:
        rows = batch.num_rows
        self.inputs.fill(batch, bucket)
        self._graphs[bucket].graph.replay()
        self._last_hidden = self._hidden[:rows] if self._hidden is not None else None
        return self._logits[:rows]

    def _padded_eager(self, batch: StepBatch, bucket: int) -> torch.Tensor:
        rows = batch.num_rows
        self.inputs.fill(batch, bucket)
        logits = self.runner.forward(self.inputs.padded_batch(batch, bucket))
        hidden = self.runner.last_hidden
        self._last_hidden = hidden[:rows] if hidden is not None else None
        return logits[:rows]

    @torch.inference_mode()
    def capture(self, *, decode: bool = True, pieces: bool = True, sampling: bool = True) -> None:
        """Capture one graph per decode bucket, largest first, then the sampling pass per row
        bucket and variant, then the piece graphs of every token bucket, largest first, all
        sharing one memory pool (CUDA only; a no-op with ``enforce_eager`` or on another device
        unless a ``graph_factory`` was given). ``decode`` / ``pieces`` / ``sampling`` False skip
        that kind (tests)."""
        if not self.uses_graphs or self._captured:
            return
        self._captured = True
        pool = self._capture_decode(None) if decode else None
        if sampling and self.graph_sampler is not None:
            pool = self._capture_sampling(pool)
        if pieces and self.pieces is not None:
            self._capture_pieces(pool)

    def _capture_decode(self, pool: Any) -> Any:
        started, reserved = time.perf_counter(), self._reserved()
        for bucket in reversed(self.buckets):
            batch = self.inputs.capture_batch(bucket)
            self._warm_up(partial(self._warm_up_decode, batch))
            graph, pool = self._graph_factory(partial(self._run_into_outputs, batch, bucket), pool)
            self._graphs[bucket] = _Graph(graph, batch)
        self._synchronize()
        log.info("captured %d decode graphs (batches %s) in %.1f s, %.0f MiB", len(self._graphs),
                 ", ".join(map(str, self.buckets)), time.perf_counter() - started, self._reserved() - reserved)
        return pool

    def _capture_sampling(self, pool: Any) -> Any:
        """The sampling pass reads the decode graphs' logits buffer in place (no copy) when it fits."""
        started, reserved = time.perf_counter(), self._reserved()
        sampler = self.graph_sampler
        if self._logits is not None:
            sampler.static.share_logits(self._logits)
        pool = sampler.capture(self._graph_factory, pool, self._warm_up)
        self._synchronize()
        log.info("captured %d sampling graphs (rows %s) in %.1f s, %.0f MiB", sampler.num_graphs,
                 ", ".join(map(str, sampler.buckets)), time.perf_counter() - started, self._reserved() - reserved)
        return pool

    def _capture_pieces(self, pool: Any) -> Any:
        started, reserved = time.perf_counter(), self._reserved()
        pool = self.pieces.capture(self._graph_factory, pool, self._warm_up)
        self._synchronize()
        log.info("captured %d piecewise graphs (%d pieces x token buckets %s) in %.1f s, %.0f MiB",
                 self.pieces.num_graphs, self.pieces.num_layers + 1, ", ".join(map(str, self.pieces.buckets)),
                 time.perf_counter() - started, self._reserved() - reserved)
        return pool

    def _reserved(self) -> float:
        """MiB the caching allocator holds on the device (0 off CUDA)."""
        return torch.cuda.memory_reserved(self.runner.device) / 2**20 if self._on_cuda else 0.0

    def _warm_up(self, run: Callable[[], None]) -> None:
        """Eager runs before a capture (on a side stream, as PyTorch's CUDA-graph notes ask):
        compiles kernels, sets up cuBLAS workspaces, and (the first time) allocates the shared
        outputs, sized by the largest bucket."""
        if not self._on_cuda:
            return run()
        device = self.runner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        self._synchronize()

    def _warm_up_decode(self, batch: StepBatch) -> None:
        for _ in range(WARMUP_STEPS):
            logits = self.runner.forward(batch)
        if self._logits is None:
            self._logits = torch.empty_like(logits)
            hidden = self.runner.last_hidden
            self._hidden = torch.empty_like(hidden) if hidden is not None else None

    def _synchronize(self) -> None:
        if self._on_cuda:
            torch.cuda.synchronize(self.runner.device)

    def _run_into_outputs(self, batch: StepBatch, bucket: int) -> None:
        self._logits[:bucket].copy_(self.runner.forward(batch))
        if self._hidden is not None:
            self._hidden[:bucket].copy_(self.runner.last_hidden)


def graph_decode_steps(runner, *, max_batch_size: int, max_model_len: int, enforce_eager: bool = False,
                       max_graph_tokens: int = MAX_GRAPH_TOKENS) -> GraphedRunner:
    """Wrap a paged runner for the engine and capture its decode graphs and (for a runner with
    the piece functions) its piecewise graphs of mixed steps up to ``max_graph_tokens`` tokens
    (CUDA, unless ``enforce_eager``; elsewhere every step stays eager). Call after the KV cache
    is allocated and before the engine thread starts."""
    max_blocks_per_seq = -(-max_model_len // runner.block_size)
    graphed = GraphedRunner(runner, max_batch_size, max_blocks_per_seq, enforce_eager,
                            max_graph_tokens=max_graph_tokens)
    prime = getattr(runner, "prime_linear_choices", None)
    if prime is not None:
        prime()
    graphed.capture()
    return graphed
