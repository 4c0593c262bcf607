"""A static-shape, sync-free sampling pass for the common rows, capturable in a CUDA graph.

The eager :class:`~sampler.sampler.Sampler` handles every row kind with host-planned index
groups, so its launch sequence changes with the batch. :class:`StaticSampler` handles only the
rows :func:`row_qualifies` accepts (no seed, no penalties, no logit_bias, no bad words, no
min_tokens ban still active, no client processor, no device DFA, no decaying top-p,
``top_logprobs <= IN_GRAPH_TOP_LOGPROBS``; greedy or temperature/top-k/top-p/min-p, with or
without a grammar bitmask) and does the same processing for all rows at once with per-row
parameter tensors, so one fixed sequence of kernels serves every batch of a bucket:

- the inputs live in static device buffers filled before each run: the logits [N, V] (or the
  graphed runner's own logits buffer, then nothing is copied), the per-row parameters
  (temperature, top-k, top-p, min-p, greedy flag: one host→device copy), the bitmask rows of
  the constrained rows and their batch rows (device→device copies);
- the pass masks with :func:`kernels.apply_token_bitmask_rows_inplace` (the eager sampler's
  kernel, one program per row; unconstrained rows point at no bitmask row), multiplies by the
  inverse temperature (1 for greedy rows: exact), truncates with
  :func:`sampler.ops.truncate_rows_inplace` (the eager sampler's threshold functions), draws
  with :func:`sampler.ops.sample_exponential_race` (torch's default generator; in a captured
  CUDA graph PyTorch advances the philox offset on every replay, so replays draw fresh
  numbers) and takes the argmax for greedy rows;
- ids, chosen logprobs and the top :data:`IN_GRAPH_TOP_LOGPROBS` values/indices go to static
  output buffers that :meth:`StaticSampler.read` brings back in one transfer.

Greedy rows give the eager sampler's tokens and logprobs exactly (the same processed logits);
sampled rows are drawn from the same processed distribution, with torch's generator instead of
the eager sampler's per-row Python RNG (which only seeded rows need, and they stay eager).
Logprob alternatives tied in value (e.g. several banned tokens at the floor) may be listed in
another order than the eager sampler lists them.

Variants (static per capture): ``random`` (some row samples: softmax + draw), ``truncate``
(some row uses top-k/top-p: one sort), ``logprobs`` (some row wants logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch

from kernels import apply_token_bitmask_rows_inplace
from sampler import ops
from sampler.params import LOGPROB_FLOOR, MAX_TOP_LOGPROBS, PendingSample, SampleResult, TokenLogprobs, read_back
from sampler.row import SamplingRow

IN_GRAPH_TOP_LOGPROBS = MAX_TOP_LOGPROBS  # every request's top_logprobs fits
_INV_TEMP, _TOP_P, _LOG_MIN_P, _TOP_K, _GREEDY, _MASK_DST = range(6)  # rows of the parameter block


class Variant(NamedTuple):
    """What one captured pass computes (see the module docstring)."""

    random: bool
    truncate: bool
    logprobs: bool


VARIANTS = tuple(Variant(r, t, lp) for r in (False, True) for t in (False, True) if r or not t for lp in (False, True))


def static_row_ok(row: SamplingRow) -> bool:
    """The parts of :func:`row_qualifies` fixed for the row's lifetime."""
    p = row.params
    return (p.seed is None and not p.has_penalties and p.logit_bias is None and not p.bad_words
            and p.custom_processor is None and not p.decays_top_p and p.top_logprobs <= IN_GRAPH_TOP_LOGPROBS)


def row_qualifies(row: SamplingRow) -> bool:
    """The static pass samples this row exactly as the eager sampler would (in distribution)."""
    p = row.params
    min_tokens_ban = p.min_tokens > 0 and bool(p.banned_until_min_tokens) and row.num_generated < p.min_tokens
    return static_row_ok(row) and row.dfa is None and not min_tokens_ban


def row_parameters(row: SamplingRow, vocab_size: int) -> tuple[float, float, float, float, float]:
    """(inverse temperature, top-p, log min-p, top-k, greedy) of a qualifying row, every step
    off for a greedy row (as the eager sampler plans them)."""
    p = row.params
    if p.greedy:
        return row_parameters_padding(vocab_size)
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    log_min_p = math.log(p.min_p) if p.min_p > 0.0 else -math.inf
    return 1.0 / p.temperature, p.top_p, log_min_p, float(top_k), 0.0


class StaticSampler:
    """Static buffers and the capturable pass for up to ``max_rows`` rows (module docstring).

    Use per step: :meth:`prepare` (None: a row does not qualify, sample eagerly), then
    :meth:`run` (or replay the graph captured from it) with the returned variant and bucket,
    then :meth:`read`.
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str,
                 logits: torch.Tensor | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.max_rows = int(max_rows)
        self.device = torch.device(device)
        self.words = (self.vocab_size + 31) // 32
        self.logits = torch.zeros(max_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        if logits is not None:
            self.share_logits(logits)
        self.bitmask = torch.full((max_rows, self.words), -1, dtype=torch.int32, device=self.device)
        self.params = torch.zeros(6, max_rows, dtype=torch.float32, device=self.device)
        self._host = torch.zeros(6, max_rows, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        self._word_rows = torch.full((max_rows + 1,), -1, dtype=torch.long, device=self.device)  # + a dummy slot
        self._row_numbers = torch.arange(max_rows, dtype=torch.long, device=self.device)
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.top = min(IN_GRAPH_TOP_LOGPROBS, self.vocab_size)
        self.packed = torch.zeros(max_rows, 2 + 2 * self.top, dtype=torch.float64, device=self.device)
        self._rows: tuple[SamplingRow, ...] = ()
        self._versions: tuple[int, ...] = ()
        self._static_ok = False
        self._dynamic_check = False
        self._variant = VARIANTS[0]
        self._host[:5] = torch.tensor(row_parameters_padding(self.vocab_size)).unsqueeze(1)
        self._host[_MASK_DST] = self.max_rows
        self.params.copy_(self._host)  # every row padding until a step fills real ones

    def share_logits(self, logits: torch.Tensor) -> bool:
        """Read the logits from ``logits`` (a graphed runner's output buffer, [>= max_rows,
        >= vocab_size] float32) instead of a copy; False (and nothing changes) when it does not fit."""
        fits = (logits.dtype == torch.float32 and logits.dim() == 2 and logits.device == self.device
                and logits.shape[0] >= self.max_rows and logits.shape[1] >= self.vocab_size)
        if fits:
            self.logits = logits[: self.max_rows, : self.vocab_size]
        return fits

    # ---------------------------------------------------------------- per step (host)
    def prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow], bucket: int,
                bitmask: torch.Tensor | None = None, indices: torch.Tensor | None = None) -> Variant | None:
        """Fill the static inputs for ``rows`` (``len(rows) <= bucket <= max_rows``) and return
        the variant to run; None when a row, the logits or the bitmask do not fit the pass
        (nothing is written then). Arguments as :meth:`Sampler.sample`'s."""
        n_rows = len(rows)
        if not 0 < n_rows <= bucket <= self.max_rows or logits.dim() != 2 or logits.shape[0] != n_rows:
            return None
        if logits.shape[1] < self.vocab_size or not self._qualifies(rows):
            return None
        if bitmask is not None and (bitmask.dim() != 2 or bitmask.shape[1] != self.words
                                    or bitmask.dtype != torch.int32 or bitmask.shape[0] > n_rows):
            return None
        host = self._host[:, :bucket]
        host[_MASK_DST].fill_(self.max_rows)  # every mask entry points at the dummy slot ...
        self.params[:, :bucket].copy_(host, non_blocking=True)
        if bitmask is not None and bitmask.shape[0]:
            masked = bitmask.shape[0]  # ... but those of the constrained rows
            dst = indices if indices is not None else self._row_numbers[:masked]
            self.params[_MASK_DST, :masked].copy_(dst.to(self.device, non_blocking=True), non_blocking=True)
            self.bitmask[:masked].copy_(bitmask, non_blocking=True)
        if not _same_memory(logits[:, : self.vocab_size], self.logits[:n_rows]):
            self.logits[:n_rows].copy_(logits[:, : self.vocab_size], non_blocking=True)
        return self._variant

    def _qualifies(self, rows: Sequence[SamplingRow]) -> bool:
        """Every row qualifies; the parameter block and the variant are rebuilt (host side) only
        when the rows or their versions change."""
        if len(rows) != len(self._rows) or any(a is not b or a.version != v
                                               for a, b, v in zip(rows, self._rows, self._versions)):
            self._plan(rows)
        if not self._static_ok:
            return False
        return all(row_qualifies(row) for row in rows) if self._dynamic_check else True

    def _plan(self, rows: Sequence[SamplingRow]) -> None:
        self._rows, self._versions = tuple(rows), tuple(r.version for r in rows)
        self._static_ok = all(static_row_ok(r) for r in rows)
        self._dynamic_check = any(r.dfa is not None or r.params.min_tokens > 0 for r in rows)
        if not self._static_ok:
            return
        params = [row_parameters(r, self.vocab_size) for r in rows]
        n = len(rows)
        self._host[:5, :n] = torch.tensor(params, dtype=torch.float32).T
        self._host[:5, n:] = torch.tensor(row_parameters_padding(self.vocab_size), dtype=torch.float32).unsqueeze(1)
        random = any(not r.params.greedy for r in rows)
        truncate = any(p[1] < 1.0 or p[3] < self.vocab_size for p in params)
        self._variant = Variant(random, truncate, any(r.params.logprobs for r in rows))

    # ---------------------------------------------------------------- the pass (device only)
    def run(self, bucket: int, variant: Variant) -> None:
        """Sample the first ``bucket`` rows of the static buffers into the output buffers: no
        host sync, shapes fixed by ``bucket`` and ``variant`` (what a graph captures)."""
        x = self.logits[:bucket]
        params = self.params[:, :bucket]
        word_rows = self._word_rows
        word_rows.fill_(-1)
        word_rows.index_copy_(0, params[_MASK_DST].long(), self._row_numbers[:bucket])
        apply_token_bitmask_rows_inplace(x, self.bitmask, word_rows[:bucket])
        ids = x.argmax(dim=-1)
        if variant.random:
            x.mul_(params[_INV_TEMP].unsqueeze(1))
            if variant.truncate:
                ops.truncate_rows_inplace(x, params[_TOP_K].long(), params[_TOP_P], params[_LOG_MIN_P])
            else:
                ops.min_p_inplace(x, None, params[_LOG_MIN_P])
            ids = torch.where(params[_GREEDY] > 0, ids, ops.sample_exponential_race(x))
        self.ids[:bucket].copy_(ids)
        if variant.logprobs:
            self._logprobs(x, ids, bucket)

    def _logprobs(self, x: torch.Tensor, ids: torch.Tensor, bucket: int) -> None:
        lp = x.log_softmax(dim=-1)  # [B, V]
        out, k = self.packed[:bucket], self.top
        out[:, 0].copy_(ids)
        out[:, 1].copy_(lp.gather(1, ids.unsqueeze(1)).squeeze(1).clamp(min=LOGPROB_FLOOR))
        top_v, top_i = lp.topk(k, dim=-1)
        out[:, 2 : 2 + k].copy_(top_v.clamp(min=LOGPROB_FLOOR))
        out[:, 2 + k :].copy_(top_i)

    # ---------------------------------------------------------------- read back
    def read(self, rows: Sequence[SamplingRow], variant: Variant) -> SampleResult:
        """The ids (and logprobs) of the last run for ``rows``: one device→host transfer."""
        return self.read_async(rows, variant).result_now()

    def read_async(self, rows: Sequence[SamplingRow], variant: Variant) -> PendingSample:
        """:meth:`read` without waiting: the ids copied out of the static buffer (the next run
        overwrites it) and on their way to the host (see :class:`PendingSample`)."""
        n = len(rows)
        ids = self.ids[:n].clone()
        if not variant.logprobs:
            return PendingSample(ids, read_back(ids), lambda host: SampleResult(host.tolist(), [None] * n))
        params = [row.params for row in rows]
        return PendingSample(ids, read_back(self.packed[:n].clone()), partial(_decode_packed, params=params, k=self.top))


def _decode_packed(host: torch.Tensor, params: list, k: int) -> SampleResult:
    """Rows of (id, chosen logprob, top-k values, top-k ids) as a result."""
    token_ids = host[:, 0].long().tolist()
    chosen = host[:, 1].tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if not p.logprobs:
            continue
        top_n = p.top_logprobs
        top = list(zip(host[i, 2 + k : 2 + k + top_n].long().tolist(), host[i, 2 : 2 + top_n].tolist()))
        logprobs[i] = TokenLogprobs(token_ids[i], chosen[i], top)
    return SampleResult(token_ids, logprobs)


def row_parameters_padding(vocab_size: int) -> tuple[float, float, float, float, float]:
    """Parameters of a padding row: greedy, every step off."""
    return 1.0, 1.0, -math.inf, float(vocab_size), 1.0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


__all__ = ["IN_GRAPH_TOP_LOGPROBS", "StaticSampler", "VARIANTS", "Variant", "row_qualifies"]
