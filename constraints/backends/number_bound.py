"""The bounded number form (:mod:`constraints.schema.number_form`) over a JSON matcher's tokens.

Under the one-line layouts a JSON answer writes its numbers in the bounded form (at most 17
significant digits, a 3-digit exponent, ...), as the backends' own JSON grammars have no such
bound and a small model can spend its whole budget on one number. :class:`BoundedNumbers` wraps a
backend's matcher: the allowed tokens are the backend's AND those that keep every number of the
text in the bounded form. Where that leaves none of the backend's tokens (a ``const`` of 10**30,
an integer ``minimum`` of 10**25, a number the grammar forces), the number in progress is
released from the bound, so a satisfiable schema stays satisfiable; the language only ever
narrows, so nothing the backend refuses is let through.

The form's automaton is run over whole tokens once per tokenizer (:class:`NumberTable`: the next
state of every (state, token) pair and, per state, the allowed tokens as a packed bitmask), so
a step costs a table lookup per accepted token and one AND per mask fill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..schema.number_form import NumberForm
from .base import CompiledConstraint, Matcher
from .narrowing import NarrowingConstraint, NarrowingMatcher
from .vocabulary import TokenizerContext, special_ids, token_bytes

if TYPE_CHECKING:
    import torch

_REJECT = -1
_SPARSE_WORDS = 64


class NumberTable:
    """The bounded form's states, and its next state after every whole token."""

    def __init__(self, ctx: TokenizerContext) -> None:
        states, byte_next = _byte_automaton()
        self.start = states.index(NumberForm.start)
        self.relaxed = np.array([states.index(NumberForm.relax(s)) for s in states], dtype=np.int16)
        self.can_end = np.array([NumberForm.can_end(s) for s in states])
        self.next = _token_next(byte_next, _vocabulary(ctx), neutral=_neutral_ids(ctx), vocab=ctx.vocab_size)
        allowed = self.next >= 0
        words = (ctx.vocab_size + 31) // 32
        packed = np.packbits(allowed, axis=1, bitorder="little")
        padded = np.zeros((len(states), words * 4), dtype=np.uint8)
        padded[:, : packed.shape[1]] = packed
        self.allowed = padded.view(np.int32)  # [states, words]: the engine's bitmask layout
        # per state, the words where it refuses some token, when there are few (between numbers and
        # inside strings the form refuses a handful of tokens: the AND touches only their words)
        self.sparse: list[np.ndarray | None] = []
        for row in self.allowed:
            refusing = np.flatnonzero(row != -1)
            self.sparse.append(refusing if len(refusing) <= _SPARSE_WORDS else None)

    @classmethod
    def of(cls, ctx: TokenizerContext) -> "NumberTable":
        """The table of ``ctx``'s tokenizer (built once, kept in its cache)."""
        return ctx.cached("number_table", lambda: cls(ctx))


def _byte_automaton() -> tuple[list[Any], np.ndarray]:
    """Every state reachable from the start (relaxed ones included) and their byte transitions
    [states, 256] (``_REJECT`` where the byte leaves the form)."""
    states: list[Any] = []
    index: dict[Any, int] = {}

    def number(state) -> int:
        if state not in index:
            index[state] = len(states)
            states.append(state)
        return index[state]

    number(NumberForm.start)
    rows: list[list[int]] = []
    while len(rows) < len(states):
        state = states[len(rows)]
        number(NumberForm.relax(state))
        row = []
        for byte in range(256):
            after = NumberForm.step(state, byte)
            row.append(_REJECT if after is None else number(after))
        rows.append(row)
    return states, np.array(rows, dtype=np.int16)


def _vocabulary(ctx: TokenizerContext) -> list[bytes]:
    raw = token_bytes(ctx)
    return [raw[i] if i < len(raw) and i < ctx.tokenizer_vocab else b"" for i in range(ctx.vocab_size)]


def _neutral_ids(ctx: TokenizerContext) -> list[int]:
    """Tokens that write no JSON text (stop and special tokens): the form's state stays."""
    return sorted((set(ctx.stop_token_ids) | special_ids(ctx.tokenizer)) & set(range(ctx.vocab_size)))


def _token_next(byte_next: np.ndarray, vocabulary: list[bytes], neutral: list[int], vocab: int) -> np.ndarray:
    """[states, vocab] int16: the state after each whole token from each state (``_REJECT`` when
    a byte of it leaves the form). Tokens are walked longest first, so each byte position
    advances a prefix of them: the work is the vocabulary's total bytes times the states."""
    count = byte_next.shape[0]
    lengths = np.array([len(b) for b in vocabulary], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    longest = int(lengths.max()) if vocab else 0
    data = np.zeros((vocab, max(longest, 1)), dtype=np.uint8)
    for row, token in enumerate(vocabulary):
        data[row, : len(token)] = np.frombuffer(token, dtype=np.uint8)
    data, sorted_lengths = data[order], lengths[order]
    current = np.repeat(np.arange(count, dtype=np.int16)[:, None], vocab, axis=1)
    padded = np.vstack([byte_next, np.full((1, 256), _REJECT, dtype=np.int16)])  # row -1: rejected stays rejected
    for position in range(longest):
        active = int(np.searchsorted(-sorted_lengths, -position, side="left"))  # tokens longer than position
        current[:, :active] = padded[current[:, :active], data[:active, position]]
    out = np.empty_like(current)
    out[:, order] = current
    empty = lengths == 0
    out[:, empty] = _REJECT  # an id with no text (unused, beyond the tokenizer) is never allowed here
    out[:, neutral] = np.arange(count, dtype=np.int16)[:, None]
    return out


class BoundedNumbers(NarrowingMatcher):
    """A JSON matcher whose numbers keep the bounded form (see the module docstring)."""

    def __init__(self, inner: Matcher, table: NumberTable) -> None:
        super().__init__(inner, table.start)
        self.table = table
        self._free_at: tuple[int, bool] | None = None  # (depth, the bound leaves no choice) cache

    # -- the form ----------------------------------------------------------------------------

    @property
    def _state(self) -> int:
        return self._states[-1]

    def _next_state(self, token_id: int, forced: bool = False) -> int:
        """The form's state after ``token_id``, relaxing the number in progress where the bound
        leaves the backend no allowed token (or the token is forced); ``_REJECT`` otherwise."""
        state = self._state
        after = int(self.table.next[state, token_id]) if 0 <= token_id < self.table.next.shape[1] else _REJECT
        if after != _REJECT or not (forced or self._bound_leaves_nothing()):
            return after
        return int(self.table.next[self.table.relaxed[state], token_id])

    def _bound_leaves_nothing(self) -> bool:
        depth = len(self._states)
        if self._free_at is not None and self._free_at[0] == depth:
            return self._free_at[1]
        import torch

        # a numpy buffer seen as a tensor: no torch op runs here (this is the bounded-call
        # worker thread, where a torch op would start an OpenMP team of its own)
        words = np.zeros((1, self.table.allowed.shape[1]), dtype=np.int32)
        self.inner.fill_bitmask(torch.from_numpy(words), 0)
        nothing = not np.any(words[0] & self.table.allowed[self._state])
        self._free_at = (depth, nothing)
        return nothing

    def _changed(self) -> None:
        self._free_at = None

    def _states_for(self, ids: Sequence[int], forced: bool) -> list[int]:
        """The form's states after each token of the longest prefix of ``ids`` it takes from here;
        ``forced``: a token the bound refuses frees its number (forced text: the grammar leaves
        nothing else)."""
        states, state = [], self._states[-1]
        width = self.table.next.shape[1]
        for token_id in ids:
            after = int(self.table.next[state, token_id]) if 0 <= token_id < width else _REJECT
            if after == _REJECT and forced and 0 <= token_id < width:
                after = int(self.table.next[self.table.relaxed[state], token_id])
            if after == _REJECT:
                break
            states.append(after)
            state = after
        return states

    # -- Matcher -------------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        # one sampled token may free its number where the bound left the backend nothing
        after = self._next_state(token_id)
        if after == _REJECT or not self.inner.accept_token(token_id):
            return False
        self._states.append(after)
        return True

    def narrow(self, bitmask: "torch.Tensor", row: int) -> None:
        """AND ``bitmask[row]`` (the backend's mask of this state) with the bound, unless that
        leaves nothing (then the number in progress goes free)."""
        state = self._states[-1]
        words = bitmask.numpy()[row]
        allowed = self.table.allowed[state]
        where = self.table.sparse[state]
        if where is None:
            bounded = words & allowed
            nothing = not bounded.any()
            if not nothing:
                words[:] = bounded
        else:
            before = words[where]
            words[where] = before & allowed[where]
            nothing = not words.any()
            if nothing:
                words[where] = before
        self._free_at = (len(self._states), nothing)

    @classmethod
    def narrow_rows(cls, matchers: Sequence["BoundedNumbers"], bitmask: "torch.Tensor", rows: list[int]) -> None:
        _narrow_rows(matchers, bitmask, rows)


def _narrow_rows(matchers: Sequence[BoundedNumbers], bitmask: "torch.Tensor", rows: list[int]) -> None:
    """:meth:`BoundedNumbers.narrow` for many rows at once (one AND over all of them)."""
    words = bitmask.numpy()
    by_table: dict[int, list[int]] = {}
    for i, matcher in enumerate(matchers):
        by_table.setdefault(id(matcher.table), []).append(i)
    for members in by_table.values():
        table = matchers[members[0]].table
        where = np.array([rows[i] for i in members])
        bounded = words[where] & table.allowed[[matchers[i]._states[-1] for i in members]]
        kept = bounded.any(axis=1)
        words[where[kept]] = bounded[kept]
        for i, keeps in zip(members, kept.tolist(), strict=True):
            matchers[i]._free_at = (len(matchers[i]._states), not keeps)


class BoundedNumbersConstraint(NarrowingConstraint):
    """A compiled JSON constraint whose matchers keep numbers in the bounded form."""

    def __init__(self, inner: CompiledConstraint, table: NumberTable) -> None:
        super().__init__(inner)
        self.table = table

    def new_matcher(self) -> Matcher:
        return BoundedNumbers(self.inner.new_matcher(), self.table)


def bound_numbers(spec, compiled: CompiledConstraint, ctx: TokenizerContext) -> CompiledConstraint:
    """``compiled`` with numbers bounded where the spec is JSON in a one-line layout (and does not
    ask for ``json_numbers: "any"``)."""
    if spec.kind not in ("json_schema", "json_object") or spec.json_numbers != "bounded":
        return compiled
    return BoundedNumbersConstraint(compiled, NumberTable.of(ctx))
