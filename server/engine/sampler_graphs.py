"""The sampling pass of a step replayed from CUDA graphs: one graph per row bucket and variant.

:class:`~sampler.graphable.StaticSampler` is the pass (static buffers, no host sync);
:class:`SamplerGraphs` captures it for every row bucket (1, 2, 4, 8, 16, 24, … up to
``MAX_GRAPH_SAMPLE_ROWS``) and every :data:`~sampler.graphable.VARIANTS` entry, into the
memory pool of the decode graphs, and serves a step when every row qualifies
(:func:`~sampler.graphable.row_qualifies`): fill the buffers, replay, read back once. The pass
is its own graph replayed right after the forward's (a decode step's full graph, a mixed step's
piecewise graphs), not part of the forward's graph: a step whose rows do not qualify then
replays the same forward graph and samples eagerly, and no forward graph is captured twice.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from sampler.graphable import VARIANTS, StaticSampler, Variant
from sampler.params import PendingSample, SampleResult
from sampler.row import SamplingRow

log = logging.getLogger("trellis.engine")

MAX_GRAPH_SAMPLE_ROWS = 256  # larger batches amortise the eager sampler's launches; a graph would hold [B, V] sorts
WARMUP_STEPS = 2


class SamplerGraphs:
    """The in-graph sampling pass per (row bucket, variant); :meth:`sample` is the engine's entry.

    ``run_uncaptured`` (test seam, with :class:`GraphedRunner`'s ``pad_eagerly``): a bucket
    without graphs runs the pass directly on the static buffers instead of declining the step.
    """

    def __init__(self, vocab_size: int, buckets: tuple[int, ...], device: torch.device, *,
                 run_uncaptured: bool = False) -> None:
        self.buckets = buckets
        self.static = StaticSampler(vocab_size, buckets[-1], device)
        self.run_uncaptured = run_uncaptured
        self._graphs: dict[tuple[int, Variant], Any] = {}

    @property
    def captured(self) -> tuple[int, ...]:
        """The row buckets whose graphs (every variant) are captured."""
        return tuple(sorted({bucket for bucket, _ in self._graphs}))

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket(self, rows: int) -> int | None:
        index = bisect.bisect_left(self.buckets, rows)
        return self.buckets[index] if rows > 0 and index < len(self.buckets) else None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None,
               indices: torch.Tensor | None = None) -> SampleResult | None:
        """``Sampler.sample``'s result for a step the pass takes (arguments alike), or None when a
        row does not qualify or the batch has no captured bucket: sample it eagerly then."""
        pending = self.sample_async(logits, rows, bitmask, indices)
        return None if pending is None else pending.result_now()

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None,
                     indices: torch.Tensor | None = None) -> PendingSample | None:
        """:meth:`sample` without waiting for the read-back (``Sampler.sample_async``'s contract)."""
        bucket = self.bucket(len(rows))
        if bucket is None or not (self.run_uncaptured or (bucket, VARIANTS[0]) in self._graphs):
            return None
        variant = self.static.prepare(logits, rows, bucket, bitmask, indices)
        if variant is None:
            return None
        graph = self._graphs.get((bucket, variant))
        if graph is not None:
            graph.replay()
        else:
            self.static.run(bucket, variant)
        return self.static.read_async(rows, variant)

    @torch.inference_mode()
    def capture(self, graph_factory: Callable, pool: Any, warm_up: Callable[[Callable[[], None]], None]) -> Any:
        """Capture every bucket's variants, largest bucket first, into ``pool``; ``warm_up(fn)``
        runs ``fn`` eagerly the way the caller warms up. Returns the pool."""
        for bucket in reversed(self.buckets):
            for variant in VARIANTS:
                run = partial(self.static.run, bucket, variant)
                warm_up(partial(_repeat, run, WARMUP_STEPS))
                graph, pool = graph_factory(run, pool)
                self._graphs[(bucket, variant)] = graph
        return pool


def _repeat(run: Callable[[], None], times: int) -> None:
    for _ in range(times):
        run()
