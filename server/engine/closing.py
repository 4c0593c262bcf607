"""close_on_length: a constrained output that still closes within its token budget.

Before each token the sequence keeps a completion from its current state that fits the budget
left (``seq.closing``, the matcher's ``shortest_completion``). A sampled or forced token is taken
when the output can still close after it; otherwise the next token of the planned completion is
taken instead (the sequence is *steered*), so the output parses and validates when the budget
ends it.
"""

from __future__ import annotations

from server.engine.failures import guarded
from server.engine.sequence import Sequence


def closes_on_length(matcher) -> bool:
    """Whether this matcher's output must close within the budget."""
    return getattr(matcher, "close_on_length", False)


def accept_closing(seq: Sequence, token: int, room: int) -> tuple[int, bool]:
    """Accept ``token`` into ``seq.matcher`` when the output can still close within ``room``
    tokens after it, else the next token of the completion planned before it. Returns the token
    taken (-1: rejected) and whether it was steered (not ``token``)."""
    matcher = seq.matcher
    plan = seq.closing if seq.closing is not None else guarded("constraint matcher", matcher.shortest_completion, room)
    if plan is not None and plan[:1] == [token]:
        seq.closing = plan[1:] if guarded("constraint matcher", matcher.accept_token, token) else None
        return (token if seq.closing is not None else -1), False
    if not guarded("constraint matcher", matcher.accept_token, token):
        return -1, False
    after = [] if matcher.is_terminated() else guarded("constraint matcher", matcher.shortest_completion, room - 1)
    if after is not None or plan is None:
        seq.closing = after
        return token, False
    matcher.rollback(1)  # no way to close after it within the budget: steer into the plan
    planned = plan[0] if plan else matcher.ctx.stop_token_ids[0]
    if not guarded("constraint matcher", matcher.accept_token, planned):
        return -1, False
    seq.closing = plan[1:]
    return planned, True

