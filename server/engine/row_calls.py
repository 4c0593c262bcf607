"""Each sequence's calls into its constraint, under the time bound (``--constraint-call-timeout``).

The engine hands a step's per-row calls into constraint backends here, in batches (one thread
hand-off per batch, :class:`~server.engine.bounded_calls.BoundedCalls`): taking the sampled
tokens (accept, forced tokens, rollback, termination), the draft planner (walking matchers) and
the scored choices; the mask fill and the client logit processors use the same worker through
``calls``. A sequence whose call does not return in time is abandoned: the call is left running
on its own thread, the matcher is dropped and never touched again, and the sequence ends with
an error naming what timed out (:data:`~server.engine.failures.CONSTRAINT_TIMEOUT`); every
other row goes on.
"""

from __future__ import annotations

from collections.abc import Callable

from server.engine.bounded_calls import BoundedCalls, Watched
from server.engine.failures import constraint_timeout
from server.engine.sequence import Sequence

Extension = list[tuple[Sequence, int]]  # (sequence, tokens fed)
PlanDrafts = Callable[[list[Sequence], Extension], tuple[list[Sequence], Extension]]


class RowCalls:
    """Runs sequences' constraint calls under the bound; ``fail(seq, message, replace_finish=)``
    ends a sequence with an error."""

    def __init__(self, timeout_s: float, fail: Callable[..., None]) -> None:
        self.calls = BoundedCalls(timeout_s, name="trellis-calls")
        self._fail = fail

    def run(self, calls: list[tuple[Sequence, Callable[[], None]]], what: str) -> None:
        """Each sequence's call, in order; a sequence whose call did not return in time is
        abandoned (``what``: what the call was doing, for its error)."""
        for seq in self.calls.run(calls):
            self.abandon(seq, what)

    def abandon(self, seq: Sequence, what: str) -> None:
        """``seq``'s constraint did not return from ``what`` in time: drop its matcher (its call
        may still be running) and end the sequence, whatever it finished with."""
        seq.matcher = None
        self._fail(seq, constraint_timeout(what, self.calls.timeout_s), replace_finish=True)

    def plan_drafts(self, plan: PlanDrafts, decode_rows: list[Sequence], extend_plan: Extension):
        """``plan(decode_rows, extend_plan)``, the draft planner: a constrained row's draft walks
        its matcher, so the planner runs under the bound (one hand-off), each matcher call
        bounded on its own. When one does not return in time its row is abandoned and left out
        of the step, and no row drafts this step (the planner stopped half-way)."""
        rows = decode_rows + [seq for seq, _ in extend_plan]
        # a draft that is not ready proposes nothing: no matcher call
        walked = [seq for seq in rows if seq.matcher is not None and seq.draft is not None and seq.draft.ready]
        if not walked or not self.calls.bounded:
            return plan(decode_rows, extend_plan)
        matchers = [seq.matcher for seq in walked]
        planned = []
        try:
            for seq in walked:
                seq.matcher = Watched(seq.matcher, seq)
            stuck = self.calls.run([(None, lambda: planned.append(plan(decode_rows, extend_plan)))])
        finally:
            for seq, matcher in zip(walked, matchers):
                seq.matcher = matcher
        if not stuck:
            return planned[0]
        if None in stuck:  # stuck outside any matcher call: the planner itself (a bug)
            raise RuntimeError("planning the step's drafts did not return in time")
        for seq in stuck:
            self.abandon(seq, "drafting")
        for seq in rows:
            seq.verify = []
        return [s for s in decode_rows if s not in stuck], [(s, take) for s, take in extend_plan if s not in stuck]

    def shutdown(self) -> None:
        self.calls.shutdown()
