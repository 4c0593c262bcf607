"""Mixed steps replayed from piecewise CUDA graphs: everything but attention, per token bucket.

A step that is not a plain decode (a jump-forward continuation, a prefill chunk, a draft, a
scored choice, per-position logits) cannot replay a full decode graph: its rows feed different
numbers of tokens, and the attention's work depends on how they split into rows. Everything
outside attention, though, is per token (norms, projections, rope, MLP), so it depends only on
the step's total token count. As vLLM does with torch.compile's graph splitting (done by hand
here), the forward is cut at each layer's attention into ``L + 1`` pieces:

- piece 0: embedding, rotary cos/sin, and layer 0's pre-attention (input norm, q/k/v
  projection);
- piece i (``1 <= i < L``): layer ``i - 1``'s post-attention (o_proj + residual, post norm,
  MLP) and layer ``i``'s pre-attention (the MLP's residual add fused into the input norm);
- piece L: the last layer's post-attention.

Each piece is captured once per token bucket ``T`` (:func:`token_buckets`) and reads and writes
only the static buffers of :class:`PieceBuffers` (tokens, positions, residual stream, last MLP
output, cos/sin, q/k/v projection, attention output). Between pieces, layer ``i``'s attention
runs eagerly on the step's real tokens with the step's real :class:`PagedAttentionMetadata`
(qk-norm + rope + cache write, then ``paged_attention``: :meth:`ModelRunner.attend`), so its
grid, split and host lengths are the step's own. After the last piece the logits gather
(``last_index``), the last residual add + final norm and lm_head run eagerly
(:meth:`ModelRunner.logits_at`). The eager forward calls the same piece
functions, so the two paths cannot drift apart.

Padding: a step of ``N`` real tokens is padded to the smallest bucket ``T >= N`` with token 0 at
position 0. The padding tokens go through the pieces but never reach attention: only the first
``N`` q/k/v are written to the cache and attend, so padding writes no key/value anywhere (not
even the null block) and lies beyond every row's query range. Their attention input is whatever
the buffer holds (zeros or an earlier step's finite output); every piece operation is per token,
so they never change a real token's values, and their hidden states are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from server.engine.step_batch import StepBatch

MAX_GRAPH_TOKENS = 512  # larger mixed steps (long prefill chunks) are compute-bound: eager costs them little
PIECE_API = ("embed", "pre_attention", "attend", "post_attention", "logits_at", "num_layers")
WARMUP_STEPS = 2


def token_buckets(max_tokens: int = MAX_GRAPH_TOKENS) -> tuple[int, ...]:
    """Token counts piece graphs are captured for: 8, 16, 24, 32, then every 16 up to 64, every
    32 up to 256 and every 64 beyond, up to ``max_tokens`` (always included). A step pads at
    most ~33% above 32 tokens (25% above 64); 16 buckets at the default 512. Empty when
    ``max_tokens`` < 1 (no piecewise graphs)."""
    sizes: list[int] = []
    size = 0
    while size < max_tokens:
        size += 8 if size < 32 else 16 if size < 64 else 32 if size < 256 else 64
        sizes.append(min(size, max_tokens))
    return tuple(sizes)


def supports_pieces(runner) -> bool:
    """The runner exposes the piece functions (:class:`ModelRunner` does; the transformers runner
    and test runners do not, and their mixed steps stay eager)."""
    return all(getattr(runner, name, None) is not None for name in PIECE_API)


class PieceBuffers:
    """Static inputs and inter-piece tensors for up to ``max_tokens`` tokens (graphs read them by
    address). Shapes and dtypes come from one probe token through the runner's first piece."""

    def __init__(self, runner, max_tokens: int) -> None:
        device = runner.device
        with torch.inference_mode():
            probe = torch.zeros(1, dtype=torch.long, device=device)
            hidden, cos, sin = runner.embed(probe, probe)
            qkv = runner.pre_attention(0, hidden, None, None)
        self.max_tokens = max_tokens
        self._ints = torch.zeros((2, max_tokens), dtype=torch.long, device=device)  # one zero_() pads both
        self.tokens, self.positions = self._ints[0], self._ints[1]
        self.residual = torch.zeros((max_tokens, hidden.shape[-1]), dtype=hidden.dtype, device=device)
        self.delta = torch.zeros_like(self.residual)  # the last layer's MLP output
        self.cos = torch.zeros((max_tokens, cos.shape[-1]), dtype=cos.dtype, device=device)
        self.sin = torch.zeros((max_tokens, sin.shape[-1]), dtype=sin.dtype, device=device)
        self.qkv = torch.zeros((max_tokens, qkv.shape[-1]), dtype=qkv.dtype, device=device)
        shape = runner.shape
        self.attn = torch.zeros((max_tokens, shape.num_heads * shape.head_dim), dtype=qkv.dtype, device=device)

    def fill(self, batch: StepBatch, bucket: int) -> None:
        """Copy the step's tokens and positions in; tokens ``N..bucket`` become padding."""
        count = batch.tokens.shape[0]
        self.tokens[:count].copy_(batch.tokens, non_blocking=True)
        self.positions[:count].copy_(batch.positions, non_blocking=True)
        self.pad(count, bucket)

    def pad(self, start: int, bucket: int) -> None:
        if start < bucket:
            self._ints[:, start:bucket].zero_()  # token 0 at position 0


class PiecewiseGraphs:
    """The piece graphs of one runner, per token bucket (see the module docstring).

    :meth:`forward` runs a step through the pieces: replayed when its bucket was captured,
    otherwise the piece functions run directly on the same buffers (the ``pad_eagerly`` test
    seam of :class:`~server.engine.cuda_graphs.GraphedRunner`)."""

    def __init__(self, runner, max_tokens: int = MAX_GRAPH_TOKENS) -> None:
        self.runner = runner
        self.num_layers = runner.num_layers
        self.buckets = token_buckets(max_tokens)
        self.buffers = PieceBuffers(runner, self.buckets[-1]) if self.buckets else None
        self._graphs: dict[int, list[Any]] = {}  # bucket -> its L + 1 piece graphs

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def num_graphs(self) -> int:
        return sum(len(graphs) for graphs in self._graphs.values())

    def bucket(self, batch: StepBatch) -> int | None:
        """The bucket of a step the pieces can run (base model, at most the largest bucket's tokens)."""
        if batch.lora is not None or not self.buckets:
            return None
        tokens = batch.tokens.shape[0]
        if tokens < 1 or tokens > self.buckets[-1]:
            return None
        return next(size for size in self.buckets if size >= tokens)

    def forward(self, batch: StepBatch, bucket: int) -> torch.Tensor:
        """Logits of ``batch`` as the runner's ``forward`` gives them, everything but attention
        and the logits replayed from the bucket's piece graphs (or run on the buffers)."""
        count, buffers = batch.tokens.shape[0], self.buffers
        buffers.fill(batch, bucket)
        graphs = self._graphs.get(bucket)
        for index in range(self.num_layers + 1):
            if graphs is not None:
                graphs[index].replay()
            else:
                self.run_piece(bucket, index)
            if index < self.num_layers:
                out = self.runner.attend(index, buffers.qkv[:count], buffers.cos[:count], buffers.sin[:count],
                                         batch.attn)
                buffers.attn[:count].copy_(out)
        return self.runner.logits_at(buffers.residual[:count], buffers.delta[:count], batch)

    def run_piece(self, bucket: int, index: int) -> None:
        """Piece ``index`` over the first ``bucket`` tokens of the buffers (what a graph captures)."""
        buffers, runner = self.buffers, self.runner
        residual = buffers.residual[:bucket]  # updated in place by the pieces' norms
        if index == 0:
            hidden, cos, sin = runner.embed(buffers.tokens[:bucket], buffers.positions[:bucket])
            residual.copy_(hidden)
            buffers.cos[:bucket].copy_(cos)
            buffers.sin[:bucket].copy_(sin)
            delta = None
        else:
            delta = runner.post_attention(index - 1, residual, buffers.attn[:bucket], None)
        if index < self.num_layers:
            buffers.qkv[:bucket].copy_(runner.pre_attention(index, residual, delta, None))
        else:
            buffers.delta[:bucket].copy_(delta)

    def capture(self, graph_factory, pool: Any, warm_up: Callable[[Callable[[], None]], None]) -> Any:
        """Capture every bucket's pieces, largest bucket first, into ``pool`` (shared with the
        decode graphs); ``warm_up(fn)`` runs ``fn`` eagerly the way the caller warms up (a side
        stream on CUDA). Returns the pool."""
        for bucket in reversed(self.buckets):
            self.buffers.pad(0, bucket)
            warm_up(partial(self._warm_up, bucket))
            graphs = []
            for index in range(self.num_layers + 1):
                graph, pool = graph_factory(partial(self.run_piece, bucket, index), pool)
                graphs.append(graph)
            self._graphs[bucket] = graphs
        return pool

    def _warm_up(self, bucket: int) -> None:
        for _ in range(WARMUP_STEPS):
            for index in range(self.num_layers + 1):
                self.run_piece(bucket, index)
