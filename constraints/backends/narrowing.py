"""A matcher that narrows another's: the backend's mask, then a rule of its own over the text.

:class:`NarrowingMatcher` holds what every such wrapper shares (the bounded number form,
:mod:`constraints.backends.number_bound`; the run-time JSON checks,
:mod:`constraints.backends.json_checks`): the backend's matcher under it, one state of its own
per accepted token, the backend's batched fill before the narrowing, and runs of tokens (forced
text, drafts) cut where the rule stops taking them before the backend checks them. A subclass
says how its rule moves (:meth:`_states_for`) and narrows a filled row (:meth:`narrow`);
:class:`NarrowingConstraint` is the compiled side.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

from .base import CompiledConstraint, Matcher, TokenDFA

if TYPE_CHECKING:
    import torch


class NarrowingMatcher(Matcher):
    """The backend's matcher (``inner``) with a rule that refuses some of the tokens it allows."""

    def __init__(self, inner: Matcher, start: Any) -> None:
        self.inner = inner
        self.ctx = inner.ctx
        self._start = start
        self._states = [start]

    def __getattr__(self, name: str) -> Any:  # backend-specific attributes (error, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def close_on_length(self) -> bool:  # type: ignore[override]
        return self.inner.close_on_length

    @close_on_length.setter
    def close_on_length(self, value: bool) -> None:
        self.inner.close_on_length = value

    # -- what a subclass says ------------------------------------------------------------------

    @abstractmethod
    def narrow(self, bitmask: "torch.Tensor", row: int) -> None:
        """Clear from ``bitmask[row]`` (the backend's mask of this state) what the rule refuses."""

    @abstractmethod
    def _states_for(self, ids: Sequence[int], forced: bool) -> list[Any]:
        """The rule's states after each token of the longest prefix of ``ids`` it takes from the
        current state (``forced``: the backend leaves nothing else, as for forced text)."""

    @classmethod
    def narrow_rows(cls, matchers: Sequence["NarrowingMatcher"], bitmask: "torch.Tensor", rows: list[int]) -> None:
        """:meth:`narrow` for many rows (a subclass may do them at once)."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.narrow(bitmask, row)

    def _changed(self) -> None:
        """The state moved other than by one accepted token (a subclass drops its caches)."""

    # -- Matcher -------------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        states = self._states_for([token_id], forced=False)
        if not states or not self.inner.accept_token(token_id):
            return False
        self._states.append(states[0])
        return True

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        self.narrow(bitmask, row)

    @classmethod
    def fill_bitmask_batch(cls, matchers: Sequence["NarrowingMatcher"], bitmask: "torch.Tensor", rows: list[int],
                           threads: int) -> None:
        """The backends' own batched fill of the inner matchers, then the rule over the rows."""
        by_kind: dict[type, list[int]] = {}
        for i, matcher in enumerate(matchers):
            by_kind.setdefault(type(matcher.inner), []).append(i)
        for kind, members in by_kind.items():
            inner_fill = getattr(kind, "fill_bitmask_batch", None)
            if inner_fill is not None and len(members) > 1:
                inner_fill([matchers[i].inner for i in members], bitmask, [rows[i] for i in members], threads)
            else:
                for i in members:
                    matchers[i].inner.fill_bitmask(bitmask, rows[i])
        cls.narrow_rows(matchers, bitmask, rows)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        self.inner.rollback(n)
        del self._states[-n:]
        self._changed()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def reset(self) -> None:
        self.inner.reset()
        self._states = [self._start]
        self._changed()

    def forced_text(self) -> str:
        return self.inner.forced_text()

    def shortest_completion(self, limit: int) -> list[int] | None:
        """The backend's completion where the rule takes it whole, else the greedy walk."""
        ids = self.inner.shortest_completion(limit)
        if ids is not None and self.valid_prefix(ids) == len(ids):
            return ids
        return super().shortest_completion(limit)

    # Runs of tokens go to the backend's own (faster) checks of a whole run, after the rule has
    # said how far into the run it goes.

    def forced_tokens(self) -> list[int]:
        ids = self.inner.forced_tokens()
        return ids[: len(self._states_for(ids, forced=True))]

    def accept_forced(self, ids: Sequence[int]) -> int:
        return self._take_run(ids, self.inner.accept_forced)

    def _accept_prefix(self, ids: Sequence[int]) -> int:
        return self._take_run(ids, self.inner._accept_prefix)

    def _take_run(self, ids: Sequence[int], take) -> int:
        """Hand the part of a run the rule takes to the backend's ``take``; keep the rule's
        states of what it took."""
        states = self._states_for(ids, forced=True)
        taken = take(list(ids[: len(states)]))
        self._states.extend(states[:taken])
        self._changed()
        return taken

    def valid_prefix(self, ids: Sequence[int]) -> int:
        """Drafts: as far as both the rule (a draft is a guess: nothing is forced) and the backend go."""
        return self.inner.valid_prefix(list(ids[: len(self._states_for(ids, forced=False))]))

    def _allowed_if_only_stops(self) -> list[int]:
        return self.inner._allowed_if_only_stops()  # stop tokens write no text: the rule keeps them


class NarrowingConstraint(CompiledConstraint):
    """A compiled constraint whose matchers are :class:`NarrowingMatcher` s over ``inner``'s."""

    def __init__(self, inner: CompiledConstraint) -> None:
        self.inner = inner

    def token_dfa(self) -> TokenDFA | None:
        return None  # the device DFA would not see the rule

    def size_bytes(self) -> int:
        return self.inner.size_bytes()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
