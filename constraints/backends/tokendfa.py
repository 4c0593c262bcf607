"""A token-level DFA: its tables as numpy arrays (the outlines backend's payload), their
TokenDFA export in flat tensors (for GPU kernels), each state's distance to a final state, and a
CPU matcher over them."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .base import Matcher, TokenDFA
from .vocabulary import TokenizerContext

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class DFATables:
    """The DFA as numpy arrays (picklable, cheap to ship from a worker process)."""

    initial_state: int
    offsets: "np.ndarray"  # int32 [S+1]
    tokens: "np.ndarray"  # int32 [E]
    next: "np.ndarray"  # int32 [E]
    final: "np.ndarray"  # bool [S]

    @property
    def num_states(self) -> int:
        return int(self.final.shape[0])

    def nbytes(self, words: int) -> int:
        return int(self.tokens.nbytes * 2 + self.offsets.nbytes) + self.num_states * words * 4


def build_allowed(tables: DFATables, words: int, stop_ids: Sequence[int]) -> "torch.Tensor":
    """Bitmask per state: transition tokens, plus stop tokens in final states."""
    import numpy as np
    import torch

    n = tables.num_states
    bits = np.zeros((n, words * 32), dtype=np.bool_)
    counts = np.diff(tables.offsets)
    rows = np.repeat(np.arange(n), counts)
    bits[rows, tables.tokens] = True
    for t in stop_ids:
        bits[tables.final, t] = True
    packed = np.packbits(bits.reshape(n, words, 32), axis=2, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).reshape(n, words).copy())


def to_token_dfa(tables: DFATables, allowed: "torch.Tensor", stop_ids: Sequence[int]) -> TokenDFA:
    import torch

    return TokenDFA(
        initial_state=tables.initial_state,
        allowed=allowed,
        trans_offsets=torch.from_numpy(tables.offsets.astype("int32")),
        trans_tokens=torch.from_numpy(tables.tokens.astype("int32")),
        trans_next=torch.from_numpy(tables.next.astype("int32")),
        final=torch.from_numpy(tables.final.astype("bool")),
        stop_token_ids=tuple(stop_ids),
    )


def dfa_distances(tables: DFATables) -> tuple["np.ndarray", "np.ndarray"]:
    """(tokens to a final state, the token of a shortest path) per DFA state; -1 where none."""
    import numpy as np

    n = tables.num_states
    offsets = tables.offsets.astype(np.int64)
    src = np.repeat(np.arange(n), np.diff(offsets))
    nxt = tables.next.astype(np.int64)
    unreachable = np.iinfo(np.int64).max // 2
    dist = np.where(tables.final, 0, unreachable).astype(np.int64)
    for _ in range(n):  # Bellman-Ford with unit weights: at most n rounds, usually a few
        cand = np.full(n, unreachable, dtype=np.int64)
        if len(src):
            np.minimum.at(cand, src, dist[nxt] + 1)
        new = np.minimum(dist, cand)
        if np.array_equal(new, dist):
            break
        dist = new
    best = np.full(n, -1, dtype=np.int64)
    if len(src):
        on_path = (dist[nxt] + 1 == dist[src]) & (dist[src] > 0) & (dist[src] < unreachable)
        edges = np.nonzero(on_path)[0][::-1]  # reversed: the first edge of each state wins
        best[src[edges]] = tables.tokens[edges]
    dist[dist >= unreachable] = -1
    return dist, best


class DFAMatcher(Matcher):
    """CPU matcher walking a token DFA; rows of ``allowed`` are copied into the bitmask."""

    def __init__(
        self,
        ctx: TokenizerContext,
        tables: DFATables,
        allowed: "torch.Tensor",
        token_bytes: Sequence[bytes],
        distances: "Callable[[], tuple[np.ndarray, np.ndarray]] | None" = None,
    ) -> None:
        self.ctx = ctx
        self._bytes = token_bytes
        self._t = tables
        self._allowed = allowed
        self._offsets = tables.offsets.tolist()
        self._tokens = tables.tokens  # numpy; searched per accept
        self._next = tables.next
        self._final = tables.final.tolist()
        self._stops = frozenset(ctx.stop_token_ids)
        self._states = [tables.initial_state]
        self._done = False
        self._distances = distances

    def _step(self, state: int, token_id: int) -> int:
        lo, hi = self._offsets[state], self._offsets[state + 1]
        i = bisect_left(self._tokens, token_id, lo, hi)
        if i < hi and self._tokens[i] == token_id:
            return int(self._next[i])
        return -1

    def accept_token(self, token_id: int) -> bool:
        if self._done:
            return False
        state = self._states[-1]
        if token_id in self._stops:
            if not self._final[state]:
                return False
            self._done = True
            self._states.append(state)
            return True
        nxt = self._step(state, token_id)
        if nxt < 0:
            return False
        self._states.append(nxt)
        return True

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        if self._done:  # terminated: nothing may follow
            bitmask[row].zero_()
            return
        bitmask[row].copy_(self._allowed[self._states[-1]])

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n >= len(self._states):
            raise ValueError("cannot roll back past the initial state")
        del self._states[-n:]
        self._done = False

    def is_terminated(self) -> bool:
        return self._done

    def reset(self) -> None:
        self._states = [self._t.initial_state]
        self._done = False

    @property
    def state(self) -> int:
        """Current DFA state (for cross-checks with the TokenDFA)."""
        return self._states[-1]

    def shortest_completion(self, limit: int) -> list[int] | None:
        """The exact shortest completion, from the DFA's per-state distances to a final state."""
        if self._distances is None:
            return super().shortest_completion(limit)
        if self._done:
            return []
        dist, best = self._distances()
        state = self._states[-1]
        if dist[state] < 0 or dist[state] > limit:
            return None
        out: list[int] = []
        while dist[state] > 0:
            token = int(best[state])
            out.append(token)
            state = self._step(state, token)
        return out

    def forced_text(self) -> str:
        """Longest text every continuation starts with: the common prefix of the allowed
        tokens' bytes, followed through the token that spells exactly that prefix."""
        out = b""
        state = self._states[-1]
        while not self._done and not self._final[state] and len(out) < 256:
            lo, hi = self._offsets[state], self._offsets[state + 1]
            if hi == lo or hi - lo > 4096:
                break
            words = [self._bytes[int(t)] for t in self._tokens[lo:hi]]
            prefix = _common_prefix(words)
            if not prefix:
                break
            try:
                i = words.index(prefix)
            except ValueError:
                out += prefix
                break
            out += prefix
            state = int(self._next[lo + i])
        return out.decode("utf-8", errors="ignore")


def _common_prefix(words: list[bytes]) -> bytes:
    lo, hi = min(words), max(words)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]
