"""Device-resident token DFA constraints: shared tables + a per-row state."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import dfa_advance

_CACHE: dict[tuple[int, str], tuple[Any, "DFATables"]] = {}


def normalize_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` so device equality checks are meaningful."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _as_tensor(value: Any) -> torch.Tensor:
    """numpy / list / tensor -> CPU tensor (uint32 words reinterpreted as int32)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return t.view(torch.int32) if t.dtype == torch.uint32 else t
    arr = np.asarray(value)
    if arr.dtype == np.uint32:
        arr = arr.view(np.int32)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _as_words(value: Any) -> torch.Tensor:
    """Packed bitmask words as int32, accepting int64 values in [0, 2**32)."""
    t = _as_tensor(value)
    if t.dtype != torch.int32:
        t = t.long() & 0xFFFFFFFF
        t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    return t


def _final_mask(final: Any, n_states: int) -> torch.Tensor:
    """[S] bool from a bool array or a collection of final state ids."""
    if isinstance(final, (set, frozenset, tuple, list)) and not all(isinstance(f, bool) for f in final):
        final = sorted(int(f) for f in final)
    if isinstance(final, (set, frozenset, tuple, list)) and not final:
        return torch.zeros(n_states, dtype=torch.bool)
    t = _as_tensor(final)
    if t.dtype == torch.bool:
        return t.reshape(n_states)
    mask = torch.zeros(n_states, dtype=torch.bool)
    mask[t.long().reshape(-1)] = True
    return mask


@dataclass(frozen=True)
class DFATables:
    """Immutable DFA tables on one device, shared by every row using the DFA.

    ``allowed`` already includes the stop tokens in final states.
    """

    allowed: torch.Tensor  # int32 [S, W]
    trans_offsets: torch.Tensor  # int32 [S + 1]
    trans_tokens: torch.Tensor  # int32 [E]
    trans_next: torch.Tensor  # int32 [E]
    final_host: torch.Tensor  # bool [S] on CPU
    initial: torch.Tensor  # int32 0-dim on device (never written)
    stop_token_ids: frozenset[int]
    max_degree: int
    device: torch.device

    @staticmethod
    def build(token_dfa: Any, device: torch.device) -> DFATables:
        """Convert a ``TokenDFA``-like object (fields: initial_state, allowed, trans_offsets,
        trans_tokens, trans_next, final, stop_token_ids) to device tables."""
        allowed = _as_words(token_dfa.allowed)
        n_states = allowed.shape[0]
        offsets = _as_tensor(token_dfa.trans_offsets).to(torch.int32).reshape(-1)
        final = _final_mask(token_dfa.final, n_states)
        stops = frozenset(int(t) for t in (getattr(token_dfa, "stop_token_ids", None) or ()))
        allowed = _with_stop_tokens(allowed, final, stops)
        degrees = offsets[1:] - offsets[:-1]
        to_dev = lambda t: t.to(device).contiguous()  # noqa: E731
        return DFATables(
            allowed=to_dev(allowed),
            trans_offsets=to_dev(offsets),
            trans_tokens=to_dev(_as_tensor(token_dfa.trans_tokens).to(torch.int32).reshape(-1)),
            trans_next=to_dev(_as_tensor(token_dfa.trans_next).to(torch.int32).reshape(-1)),
            final_host=final,
            initial=torch.tensor(int(token_dfa.initial_state), dtype=torch.int32, device=device),
            stop_token_ids=stops,
            max_degree=int(degrees.max()) if n_states else 0,
            device=device,
        )

    @staticmethod
    def get(token_dfa: Any, device: torch.device) -> DFATables:
        """Tables for ``token_dfa`` on ``device``, built once per (object, device)."""
        if isinstance(token_dfa, DFATables):
            return token_dfa
        key = (id(token_dfa), str(device))
        hit = _CACHE.get(key)
        if hit is not None:
            ref, tables = hit
            if (ref() if isinstance(ref, weakref.ref) else ref) is token_dfa:
                return tables
        tables = DFATables.build(token_dfa, device)
        try:
            ref: Any = weakref.ref(token_dfa, lambda _r, k=key: _CACHE.pop(k, None))
        except TypeError:  # not weak-referenceable: keep it alive so its id stays unique
            ref = token_dfa
        _CACHE[key] = (ref, tables)
        return tables

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[R] int32 states x [R] tokens -> [R] int32 next states (on device)."""
        return dfa_advance(states, tokens, self.trans_offsets, self.trans_tokens, self.trans_next, self.max_degree)


def _with_stop_tokens(allowed: torch.Tensor, final: torch.Tensor, stops: Iterable[int]) -> torch.Tensor:
    """Allow the stop tokens in final states (widening W if a stop id needs it)."""
    stops = sorted(stops)
    if not stops or not bool(final.any()):
        return allowed
    n_words = max(allowed.shape[1], stops[-1] // 32 + 1)
    if n_words > allowed.shape[1]:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], n_words - allowed.shape[1])], 1)
    bits = torch.zeros(n_words, dtype=torch.int64)
    for t in stops:
        bits[t // 32] |= 1 << (t % 32)
    stop_words = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    allowed = allowed.clone()
    allowed[final] |= stop_words
    return allowed


class DeviceDFA:
    """A DFA constraint for one sequence: shared device tables + this row's state.

    The state lives on the device as a 0-dim int32 tensor. Tokens given to
    :meth:`push` (``SamplingRow.append_token`` does it) are queued and consumed in one
    batched ``dfa_advance`` at the next ``Sampler.sample`` call (or when the state is read),
    so nothing is read back to the host per token. State -1 means terminated: a token with
    no transition (a stop token ends the sequence; anything else is invalid) was consumed.
    """

    def __init__(self, token_dfa: Any, device: torch.device | str = "cpu") -> None:
        """Build (or reuse cached) tables of ``token_dfa`` on ``device``; start at its initial state."""
        self.tables = DFATables.get(token_dfa, normalize_device(device))
        self._state = self.tables.initial
        self._prev_state = self.tables.initial
        self._pending: list[int] = []
        self._last_token: int | None = None
        self._owner: Any = None

    def fork(self) -> DeviceDFA:
        """An independent copy sharing the tables (for n > 1 choices)."""
        twin = DeviceDFA.__new__(DeviceDFA)
        twin.tables, twin._state, twin._prev_state = self.tables, self._state, self._prev_state
        twin._pending, twin._last_token, twin._owner = list(self._pending), self._last_token, None
        return twin

    def push(self, token_id: int) -> None:
        """Queue a consumed token (advanced lazily, batched, on the device)."""
        self._pending.append(int(token_id))
        self._last_token = int(token_id)

    def flush(self) -> None:
        """Consume queued tokens now (one tiny device op per token)."""
        while self._pending:
            advance_batch([self], [self._pending.pop(0)])

    @property
    def state_tensor(self) -> torch.Tensor:
        """Current state as a 0-dim int32 device tensor (no host sync)."""
        self.flush()
        return self._state

    @property
    def state(self) -> int:
        """Current state id (-1 = terminated). Reads the device: a host sync."""
        return int(self.state_tensor)

    def is_terminated(self) -> bool:
        """True once a token without a transition (e.g. a stop token) was consumed."""
        return self.state < 0

    def is_final(self) -> bool:
        """True in an accepting state, or after a stop token consumed in one."""
        state = self.state
        if state >= 0:
            return bool(self.tables.final_host[state])
        if self._last_token in self.tables.stop_token_ids:
            prev = int(self._prev_state)
            return prev >= 0 and bool(self.tables.final_host[prev])
        return False


def advance_batch(dfas: list[DeviceDFA], tokens: list[int]) -> None:
    """Advance DFAs sharing one table by one token each, in one device call."""
    tables = dfas[0].tables
    states = torch.stack([d._state for d in dfas])  # [R] int32
    toks = torch.tensor(tokens, dtype=torch.int32)
    if tables.device.type == "cuda":
        toks = toks.pin_memory().to(tables.device, non_blocking=True)
    new = tables.advance(states, toks.to(tables.device))  # [R]
    for i, d in enumerate(dfas):
        d._prev_state, d._state = d._state, new[i]


def flush_dfas(dfas: list[DeviceDFA]) -> None:
    """Consume all queued tokens of many DFAs: batched per table, one round per queued token."""
    groups: dict[int, list[DeviceDFA]] = {}
    for d in dfas:
        if d._pending:
            groups.setdefault(id(d.tables), []).append(d)
    for group in groups.values():
        while group:
            advance_batch(group, [d._pending.pop(0) for d in group])
            group = [d for d in group if d._pending]
