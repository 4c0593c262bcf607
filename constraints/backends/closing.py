"""Completions that close an output within a token budget (``close_on_length``).

Two ways of finding a completion from a matcher's current state:

* a token DFA (regex / choice) knows each state's exact distance to a final state: a
  backwards breadth-first search over its transitions, done once per compiled constraint
  (:func:`constraints.backends.tokendfa.dfa_distances`);
* any other matcher (llguidance, xgrammar) is walked greedily: text the grammar forces is
  taken as its canonical tokens, and elsewhere the allowed token
  that ranks first in a fixed per-tokenizer order (stop tokens, then tokens made only of closing
  brackets and quotes, then other punctuation, then the longest letters/digits, then the rest)
  is accepted, until a stop token is allowed; the walk is rolled back afterwards. The result is
  a valid completion, not always the shortest one: an upper bound on it.

Either way the completion excludes the final stop token: when the budget ends right after it,
the output is complete (finish_reason "length").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .vocabulary import TokenizerContext, special_ids, token_bytes

if TYPE_CHECKING:
    import numpy as np
    import torch

MAX_COMPLETION_TOKENS = 1024  # the greedy walk gives up after this many tokens
_CLOSERS = frozenset(b'"}])')
_CLOSER_ORDER = b'}])"'  # a quote last: at a key position it would open one
_OPENERS = frozenset(b"{[(")
_SIGNS = frozenset(b"-+")


class Walkable(Protocol):
    """What a walk uses of a matcher. Every :class:`constraints.backends.base.Matcher` is one:
    the interface walks here for its default ``shortest_completion``, so this module names only
    the methods it calls instead of importing the interface."""

    ctx: TokenizerContext

    def accept_token(self, token_id: int) -> bool: ...

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None: ...

    def rollback(self, n: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def forced_text(self) -> str: ...


def _rank(raw: bytes) -> tuple[int, int]:
    """(tier, tie-break) of a token's bytes; lower ranks first."""
    if not raw or not raw.isascii():
        return 4, len(raw) or 1 << 20
    if len(raw) == 1 and raw[0] in _CLOSERS:
        return 1, _CLOSER_ORDER.index(raw[0])
    if all(b in _CLOSERS for b in raw) and b'""' not in raw:
        return 1, 10 - len(raw)
    if raw.isalnum():
        return 3, -len(raw)
    punct = all(not chr(b).isalnum() and not chr(b).isspace() for b in raw)
    if punct and not any(b in _OPENERS for b in raw) and raw[0] not in _SIGNS:
        return 2, -len(raw)
    return 4, len(raw)


def closing_order(ctx: TokenizerContext) -> "np.ndarray":
    """Token ids in the greedy walk's order of preference (built once per tokenizer)."""
    import numpy as np

    order = ctx.cache.get("closing_order")
    if order is None:
        raw = token_bytes(ctx)
        stops = set(ctx.stop_token_ids)
        specials = special_ids(ctx.tokenizer) - stops
        keys = []
        for t in range(ctx.vocab_size):
            if t in stops:
                keys.append((0, 0, t))
            elif t >= ctx.tokenizer_vocab or t >= len(raw) or t in specials:
                keys.append((5, 0, t))
            else:
                keys.append((*_rank(raw[t]), t))
        order = np.asarray([k[2] for k in sorted(keys)], dtype=np.int64)
        ctx.cache["closing_order"] = order
    return order


def greedy_completion(matcher: Walkable, limit: int) -> list[int] | None:
    """The greedy walk's completion from ``matcher``'s state (state left unchanged), or None
    when it needs more than ``limit`` tokens."""
    import torch

    if matcher.is_terminated():
        return []
    ctx = matcher.ctx
    walk = _Walk(matcher, closing_order(ctx), frozenset(ctx.stop_token_ids))
    mask = torch.zeros((1, (ctx.vocab_size + 31) // 32), dtype=torch.int32)
    try:
        for _ in range(min(limit, MAX_COMPLETION_TOKENS) + 1):
            if _take_forced(matcher, walk.taken, limit):
                continue
            token = walk.choose(mask)
            if token is None:
                return None  # nothing allowed: a dead end (the matcher hit a limit)
            if token in walk.stops:
                return list(walk.taken)
            if len(walk.taken) >= limit or not matcher.accept_token(token):
                return None
            walk.taken.append(token)
        return None
    finally:
        matcher.rollback(len(walk.taken))


def _take_forced(matcher: Walkable, taken: list[int], limit: int) -> bool:
    """Accept the text the grammar forces here, tokenized canonically (no mask needed: a
    closing's keys and punctuation are mostly forced); True when at least one token was taken."""
    text = matcher.forced_text()
    if not text:
        return False
    ctx = matcher.ctx
    ids = ctx.encode(text)
    if ctx.decode(ids) != text:
        return False
    before = len(taken)
    for token in ids[: max(limit - before, 0)]:
        if not matcher.accept_token(token):
            break
        taken.append(token)
    return len(taken) > before


def closing_token(matcher: Walkable) -> int | None:
    """The first token of the greedy walk towards closing from ``matcher``'s state (the token
    that ends the value being written: a string's quote, an object's brace), state unchanged;
    None when only a stop token or nothing is allowed."""
    import torch

    if matcher.is_terminated():
        return None
    ctx = matcher.ctx
    walk = _Walk(matcher, closing_order(ctx), frozenset(ctx.stop_token_ids))
    token = walk.choose(torch.zeros((1, (ctx.vocab_size + 31) // 32), dtype=torch.int32))
    return None if token is None or token in walk.stops else token


class _Walk:
    """One greedy walk: the tokens taken so far and, per mask seen, the tokens chosen there
    (a token is not chosen twice at the same mask, which breaks loops such as a closing bracket
    that is string content)."""

    TRIALS = 6  # candidates tried for whether they change the mask

    def __init__(self, matcher: Walkable, order: "np.ndarray", stops: frozenset[int]) -> None:
        self.matcher = matcher
        self.order = order
        self.stops = stops
        self.taken: list[int] = []
        self.chosen: dict[bytes, set[int]] = {}

    def choose(self, mask: "torch.Tensor") -> int | None:
        """The first-ranked allowed token whose acceptance changes the mask (among the first
        few candidates), else the first candidate."""
        mask.zero_()
        self.matcher.fill_bitmask(mask, 0)
        key = mask.numpy().tobytes()
        done = self.chosen.setdefault(key, set())
        allowed = self._allowed_ranked(mask, len(done) + self.TRIALS)
        if not allowed:
            return None
        # a mask seen before may belong to another state: when every token was chosen there, repeat
        candidates = [t for t in allowed if t not in done] or allowed
        if candidates[0] in self.stops:
            return candidates[0]
        choice = next((t for t in candidates[: self.TRIALS] if self._changes_mask(t, mask)), candidates[0])
        done.add(choice)
        return choice

    def _allowed_ranked(self, mask: "torch.Tensor", count: int) -> list[int]:
        import numpy as np

        vocab = len(self.order)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]
        positions = np.flatnonzero(bits[self.order])[:count]
        return self.order[positions].tolist()

    def _changes_mask(self, token: int, mask: "torch.Tensor") -> bool:
        import torch

        if not self.matcher.accept_token(token):
            return False
        after = torch.zeros_like(mask)
        try:
            self.matcher.fill_bitmask(after, 0)
        finally:
            self.matcher.rollback(1)
        return not torch.equal(after, mask)
