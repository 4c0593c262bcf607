"""The batched sampler: masks, logit processing and seeded sampling in one pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import apply_penalties_inplace, apply_token_bitmask_inplace, dfa_apply_mask_inplace
from sampler import ops
from sampler.custom import RequestView, Runner, apply_group, run_directly
from sampler.dfa import DeviceDFA, DFATables, flush_dfas, normalize_device
from sampler.params import LOGPROB_FLOOR, PendingSample, SampleResult, SamplingParams, TokenLogprobs, read_back
from sampler.pool import PenaltyPool, to_device
from sampler.row import SamplingRow

Idx = torch.Tensor | None  # row indices into the batch; None = every row


@dataclass
class _Plan:
    """Static, host-derived description of a batch (cached while the batch is unchanged)."""

    rows: tuple[SamplingRow, ...]
    versions: tuple[int, ...]
    random_pos: list[int]
    random_idx: Idx
    inv_temp: torch.Tensor | None = None  # [B] float32 (1 for greedy rows)
    top_k: tuple[Idx, torch.Tensor, int] | None = None  # rows with top-k only
    top_k_p: tuple[Idx, torch.Tensor, torch.Tensor] | None = None  # rows with top-p (+top-k)
    min_p: tuple[Idx, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, values
    penalty: tuple[Idx, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalty_pos: list[int] = field(default_factory=list)
    dfa_groups: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    min_tokens_pos: list[int] = field(default_factory=list)
    bad_words_pos: list[int] = field(default_factory=list)
    top_p_pos: list[int] = field(default_factory=list)  # rows of top_k_p, in order
    top_p_decays: bool = False  # some top-p row decays: its p is re-read every step
    custom_groups: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # rows per processor
    logprob_pos: list[int] = field(default_factory=list)
    logprob_idx: Idx = None
    top_max: int = 0

    @property
    def all_greedy(self) -> bool:
        return not self.random_pos

    @property
    def needs_processing(self) -> bool:
        """Anything besides temperature + sampling (host-known, no per-step state)."""
        return any((self.top_k, self.top_k_p, self.min_p, self.bias, self.penalty, self.dfa_groups))

    def matches(self, rows: Sequence[SamplingRow]) -> bool:
        return len(rows) == len(self.rows) and all(
            a is b and a.version == v for a, b, v in zip(rows, self.rows, self.versions)
        )


class Sampler:
    """Turns a batch of logits into one token per row.

    Processing order per row: a client logit processor (``params.custom_processor``), bitmask,
    DFA mask, logit_bias, min_tokens and bad-word bans, repetition/presence/frequency penalties,
    temperature (0 = greedy argmax), top-k, top-p, min-p, then sampling. Greedy rows skip
    temperature/top-k/top-p/min-p. Sampling uses one uniform per row from the row's own seeded RNG
    and inverse-CDF sampling, so a seed gives the same tokens whatever the batch composition/position.
    The only host syncs are reading the sampled ids (and logprobs) at the end (and, for rows with a
    client logit processor, checking its output).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, *, run_processor: Runner = run_directly) -> None:
        """``vocab_size``: number of sampleable tokens; wider logits (padded model vocab)
        are truncated to it. ``run_processor`` makes each client logit processor call (the
        engine's runs it under a time bound; see :mod:`sampler.custom`)."""
        self.vocab_size = int(vocab_size)
        self.device = normalize_device(device)
        self._run_processor = run_processor
        self._pool: PenaltyPool | None = None
        self._plan: _Plan | None = None

    # ----------------------------------------------------------------- rows / DFAs
    def new_row(self, params: SamplingParams, prompt_token_ids: Sequence[int], *, choice_index: int = 0) -> SamplingRow:
        """Per-sequence state; the prompt is only kept (on device) for the repetition penalty.

        ``choice_index`` (n > 1 choices of one seeded request): choice 0 uses ``params.seed``
        as is, choice i > 0 a seed derived from (seed, i), so choices differ but each stays
        reproducible.
        """
        pool = None
        if params.has_penalties:
            if self._pool is None:
                self._pool = PenaltyPool(self.vocab_size, self.device)
            pool = self._pool
        return SamplingRow(params, prompt_token_ids, self.device, pool, choice_index)

    def new_dfa(self, token_dfa: Any) -> DeviceDFA:
        """A :class:`DeviceDFA` on this sampler's device (tables cached per TokenDFA object)."""
        return DeviceDFA(token_dfa, self.device)

    # ----------------------------------------------------------------- main pass
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
        bitmask_indices: torch.Tensor | None = None,
    ) -> SampleResult:
        """Sample one token for each row (see the class doc for the processing order) and read
        the result back (the pass's one host sync).

        Args:
            logits: [B, V'] with ``V' >= vocab_size``; may be modified in place.
            rows: the B rows, in logits order.
            bitmask: int32 [R, W] grammar bitmask for the constrained rows only, aligned with
                ``bitmask_indices`` ([R] batch positions); or [B, W] with indices None.
                Pass it on the sampler's device (or pinned) to avoid a blocking copy.
        """
        return self.sample_async(logits, rows, bitmask, bitmask_indices).result_now()

    def sample_async(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
        bitmask_indices: torch.Tensor | None = None,
    ) -> PendingSample:
        """:meth:`sample` without waiting: the ids stay on the device and reach the host by one
        non-blocking copy; read :meth:`PendingSample.result` once the device got there."""
        n_rows = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n_rows:
            raise ValueError(f"logits must be [{n_rows}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab_size {self.vocab_size}")
        if n_rows == 0:
            empty = torch.empty(0, dtype=torch.long)
            return PendingSample(empty, empty, lambda _host: SampleResult([], []))
        plan = self._plan_for(rows)
        self._flush(rows, plan)
        x = logits[:, : self.vocab_size]  # [B, V]
        failures = self._apply_custom(x, rows, plan)
        bans = self._dynamic_bans(rows, plan)
        if plan.all_greedy and not plan.needs_processing and bans is None and bitmask is None:
            return self._finish(x.argmax(dim=-1), x, rows, plan, failures)  # fast path: plain greedy
        x = self._process(x, rows, plan, bans, bitmask, bitmask_indices)
        return self._finish(self._draw(x, rows, plan), x, rows, plan, failures)

    def process_logits(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        bitmask: torch.Tensor | None = None,
        bitmask_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The [B, vocab_size] float32 logits ``sample`` would draw from (log_softmax of a row
        is its sampled distribution), without drawing. For tests, debugging and scoring."""
        plan = self._plan_for(rows)
        self._flush(rows, plan)
        x = logits[:, : self.vocab_size].float().clone()
        failures = self._apply_custom(x, rows, plan)
        if failures:
            raise ValueError(next(iter(failures.values())))
        bans = self._dynamic_bans(rows, plan)
        return self._process(x, rows, plan, bans, bitmask, bitmask_indices)

    def _process(
        self,
        x: torch.Tensor,
        rows: Sequence[SamplingRow],
        plan: _Plan,
        bans: tuple[torch.Tensor, ...] | None,
        bitmask: torch.Tensor | None,
        bitmask_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """All logits processing, in place where possible; returns the float32 [B, V] result."""
        if x.dtype != torch.float32:
            x = x.float()
        self._apply_masks(x, plan, rows, bitmask, bitmask_indices)
        if plan.bias is not None:
            x.index_put_(plan.bias[:2], plan.bias[2], accumulate=True)
        if bans is not None:
            ops.ban_tokens_soft(x, *bans)
        self._penalties_and_temperature(x, plan)
        self._truncate(x, rows, plan)
        return x

    # ----------------------------------------------------------------- steps
    def _apply_custom(self, x: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan) -> dict[int, str]:
        """Client logit processors, one call per processor over its rows; {row: error} of the
        rows a processor failed (they are left harmless to sample from)."""
        failures: dict[int, str] = {}
        for positions, idx in plan.custom_groups:
            processor = rows[positions[0]].params.custom_processor
            params = [_processor_params(rows[i]) for i in positions]
            failures.update(apply_group(processor, x, positions, idx, params, self._run_processor))
        return failures

    def _apply_masks(
        self, x: torch.Tensor, plan: _Plan, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None, indices: torch.Tensor | None
    ) -> None:
        if bitmask is not None:
            bitmask = bitmask.to(self.device, non_blocking=True)
            if indices is not None and not isinstance(indices, torch.Tensor):
                indices = to_device(list(indices), torch.long, self.device)
            elif indices is not None:
                indices = indices.to(self.device, dtype=torch.long, non_blocking=True)
            apply_token_bitmask_inplace(x, bitmask, indices)
        for positions, idx in plan.dfa_groups:
            dfas = [rows[i].dfa for i in positions]
            states = torch.stack([d._state for d in dfas])  # [R] int32
            dfa_apply_mask_inplace(x, dfas[0].tables.allowed, states, idx)

    def _dynamic_bans(self, rows: Sequence[SamplingRow], plan: _Plan) -> tuple[torch.Tensor, ...] | None:
        """(unique rows, ban rows, ban tokens) for this step: the stop tokens of rows still below
        ``min_tokens`` and the tokens that would complete a row's bad word."""
        banned: dict[int, set[int]] = {}
        for i in plan.min_tokens_pos:
            row = rows[i]
            if row.num_generated < row.params.min_tokens:
                banned.setdefault(i, set()).update(row.params.banned_until_min_tokens)
        for i in plan.bad_words_pos:
            toks = rows[i].banned_words_now()
            if toks:
                banned.setdefault(i, set()).update(toks)
        active, ban_rows, ban_toks = [], [], []
        for i, toks in banned.items():
            toks = [t for t in toks if 0 <= t < self.vocab_size]
            if toks:
                active.append(i)
                ban_rows += [i] * len(toks)
                ban_toks += toks
        if not ban_toks:
            return None
        idx = to_device(active + ban_rows + ban_toks, torch.long, self.device)
        n, m = len(active), len(ban_rows)
        return idx[:n], idx[n : n + m], idx[n + m :]

    def _penalties_and_temperature(self, x: torch.Tensor, plan: _Plan) -> None:
        inv_temp = plan.inv_temp
        if plan.penalty is not None:
            idx, slots, rep, pres, freq = plan.penalty
            fuse = idx is None and inv_temp is not None
            pool = self._pool
            apply_penalties_inplace(
                x, slots, pool.counts, pool.prompt_mask, rep, pres, freq, idx, inv_temp if fuse else None
            )
            if fuse:
                return
        if inv_temp is not None:
            x.mul_(inv_temp.unsqueeze(1))

    def _truncate(self, x: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan) -> None:
        if plan.top_k is not None:
            ops.top_k_inplace(x, *plan.top_k)
        if plan.top_k_p is not None:
            idx, k, p = plan.top_k_p
            if plan.top_p_decays:  # one small host->device copy per step, only for decaying rows
                p = to_device([rows[i].top_p for i in plan.top_p_pos], torch.float32, self.device)
            ops.top_k_top_p_inplace(x, idx, k, p)
        if plan.min_p is not None:
            ops.min_p_inplace(x, *plan.min_p)

    def _draw(self, x: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan) -> torch.Tensor:
        """[B] long sampled ids: argmax for greedy rows, inverse CDF for the others."""
        if plan.all_greedy:
            return x.argmax(dim=-1)
        uniforms = [rows[i].rng.random() for i in plan.random_pos]
        u = to_device(uniforms, torch.float64, self.device)  # [R]
        drawn = ops.sample_inverse_cdf(ops.take(x, plan.random_idx), u)  # [R]
        if plan.random_idx is None:
            return drawn
        ids = x.argmax(dim=-1)
        ids.index_copy_(0, plan.random_idx, drawn)
        return ids

    def _finish(
        self, ids: torch.Tensor, x: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan, failures: dict[int, str]
    ) -> PendingSample:
        """Start reading ids and logprobs back: one device→host transfer (the pass's host sync,
        once its result is read).

        With logprobs, the ids, chosen logprobs and top-k values/indices travel together as one
        float64 tensor: float64 holds every float32 value and every token id exactly, so the
        host sees the same numbers as from one transfer per piece."""
        if not plan.logprob_pos:
            n = len(rows)
            return PendingSample(ids, read_back(ids), lambda host: SampleResult(host.tolist(), [None] * n), failures)
        lp = ops.take(x.float(), plan.logprob_idx).log_softmax(dim=-1)  # [L, V]
        chosen_ids = ops.take(ids.unsqueeze(1), plan.logprob_idx)  # [L, 1]
        chosen = lp.gather(1, chosen_ids).squeeze(1).clamp(min=LOGPROB_FLOOR)  # [L]
        pieces = [ids.double(), chosen.double()]
        k = min(plan.top_max, lp.shape[1])
        if k:
            top_v, top_i = lp.topk(k, dim=-1)
            pieces += [top_v.clamp(min=LOGPROB_FLOOR).double().flatten(), top_i.double().flatten()]
        params = [row.params for row in rows]
        decode = lambda host: _decode_with_logprobs(host, params, plan.logprob_pos, k)  # noqa: E731
        return PendingSample(ids, read_back(torch.cat(pieces)), decode, failures)

    # ----------------------------------------------------------------- bookkeeping
    def _flush(self, rows: Sequence[SamplingRow], plan: _Plan) -> None:
        """Apply tokens appended since the last pass: one scatter for counts, batched DFA steps."""
        slots: list[int] = []
        toks: list[int] = []
        for i in plan.penalty_pos:
            row = rows[i]
            for t in row.pending_counts:
                if 0 <= t < self.vocab_size:
                    slots.append(row.slot)
                    toks.append(t)
            row.pending_counts.clear()
        if slots:
            self._pool.add_tokens(slots, toks)
        dfas = [rows[i].dfa for positions, _ in plan.dfa_groups for i in positions]
        if dfas:
            flush_dfas(dfas)

    def _plan_for(self, rows: Sequence[SamplingRow]) -> _Plan:
        if self._plan is None or not self._plan.matches(rows):
            self._plan = _build_plan(rows, self.vocab_size, self.device)
        return self._plan


def _decode_with_logprobs(host: torch.Tensor, params: list[SamplingParams], logprob_pos: list[int], k: int) -> SampleResult:
    """The packed float64 read-back (ids, chosen logprobs, top-k values, top-k ids) as a result."""
    n, m = len(params), len(logprob_pos)
    token_ids = host[:n].long().tolist()
    chosen_list = host[n : n + m].tolist()
    top_v_list = host[n + m : n + m + m * k].view(m, k).tolist() if k else None
    top_i_list = host[n + m + m * k :].view(m, k).long().tolist() if k else None
    logprobs: list[TokenLogprobs | None] = [None] * n
    for j, i in enumerate(logprob_pos):
        top_n = params[i].top_logprobs
        top = list(zip(top_i_list[j][:top_n], top_v_list[j][:top_n])) if top_n and k else []
        logprobs[i] = TokenLogprobs(token_ids[i], chosen_list[j], top)
    return SampleResult(token_ids, logprobs)


def _processor_params(row: SamplingRow) -> dict[str, Any]:
    """A row's entry of ``custom_param_list``: its ``custom_params`` plus SGLang's ``__req__``."""
    params = dict(row.params.custom_params or {})
    params["__req__"] = RequestView(row.prompt_token_ids or [], row.output_token_ids)
    return params


def _index(positions: list[int], n_rows: int, device: torch.device) -> Idx:
    """Device index tensor for ``positions``, or None when they cover the whole batch in order."""
    if len(positions) == n_rows:
        return None
    return to_device(positions, torch.long, device)


def _build_plan(rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> _Plan:
    """Everything about a batch that is fixed while its rows (and their DFAs) are unchanged."""
    n = len(rows)
    params: list[SamplingParams] = [r.params for r in rows]
    random_pos = [i for i, p in enumerate(params) if not p.greedy]
    plan = _Plan(tuple(rows), tuple(r.version for r in rows), random_pos, _index(random_pos, n, device))
    f32 = lambda vals: to_device(vals, torch.float32, device)  # noqa: E731
    i64 = lambda vals: to_device(vals, torch.long, device)  # noqa: E731
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        plan.inv_temp = f32([1.0 / t for t in temps])
    k_eff = [p.top_k if (not p.greedy and 0 < p.top_k < vocab) else vocab for p in params]
    pos_kp = [i for i in random_pos if params[i].uses_top_p]
    pos_k = [i for i in random_pos if not params[i].uses_top_p and k_eff[i] < vocab]
    if pos_k:
        ks = [k_eff[i] for i in pos_k]
        plan.top_k = (_index(pos_k, n, device), i64(ks), max(ks))
    if pos_kp:
        plan.top_k_p = (_index(pos_kp, n, device), i64([k_eff[i] for i in pos_kp]), f32([params[i].top_p for i in pos_kp]))
        plan.top_p_pos = pos_kp
        plan.top_p_decays = any(params[i].decays_top_p for i in pos_kp)
    pos_mp = [i for i in random_pos if params[i].min_p > 0.0]
    if pos_mp:
        plan.min_p = (_index(pos_mp, n, device), f32([math.log(params[i].min_p) for i in pos_mp]))
    bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items() if 0 <= t < vocab]
    if bias:
        b_rows, b_toks, b_vals = zip(*bias)
        plan.bias = (i64(list(b_rows)), i64(list(b_toks)), f32(list(b_vals)))
    plan.penalty_pos = [i for i, r in enumerate(rows) if r.slot is not None]
    if plan.penalty_pos:
        pp = plan.penalty_pos
        plan.penalty = (
            _index(pp, n, device),
            i64([rows[i].slot for i in pp]),
            f32([params[i].repetition_penalty for i in pp]),
            f32([params[i].presence_penalty for i in pp]),
            f32([params[i].frequency_penalty for i in pp]),
        )
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.dfa is not None:
            groups.setdefault(id(r.dfa.tables), []).append(i)
    plan.dfa_groups = [(pos, i64(pos)) for pos in groups.values()]
    by_processor: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if p.custom_processor is not None:
            by_processor.setdefault(id(p.custom_processor), []).append(i)
    plan.custom_groups = [(pos, i64(pos)) for pos in by_processor.values()]
    plan.min_tokens_pos = [i for i, p in enumerate(params) if p.min_tokens > 0 and p.banned_until_min_tokens]
    plan.bad_words_pos = [i for i, p in enumerate(params) if p.bad_words]
    plan.logprob_pos = [i for i, p in enumerate(params) if p.logprobs]
    if plan.logprob_pos:
        plan.logprob_idx = _index(plan.logprob_pos, n, device)
        plan.top_max = max(params[i].top_logprobs for i in plan.logprob_pos)
    return plan


__all__ = ["DFATables", "Sampler"]
