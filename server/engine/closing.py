"""close_on_length: a constrained output that still closes within its token budget.

Before each token the sequence keeps a completion from its current state that fits the budget
left (``seq.closing``, the matcher's ``shortest_completion``). A sampled or forced token is taken
when the output can still close after it; otherwise the next token of the planned completion is
taken instead (the sequence is *steered*), so the output parses and validates when the budget
ends it.

After a token that is not the plan's next one, the plan is first checked from the new state (a
few token acceptances: inside a string value the same closing still fits) and only searched
anew when it no longer completes the output or no longer fits the budget (the search fills a
mask per token of the completion: ~10 ms with llguidance, once per token before).
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
    after = [] if matcher.is_terminated() else _completion(matcher, plan, room - 1)
    if after is not None or plan is None:
        seq.closing = after
        return token, False
    matcher.rollback(1)  # no way to close after it within the budget: steer into the plan
    planned = plan[0] if plan else matcher.ctx.stop_token_ids[0]
    if not guarded("constraint matcher", matcher.accept_token, planned):
        return -1, False
    seq.closing = plan[1:]
    return planned, True



def _completion(matcher, previous: list[int] | None, limit: int) -> list[int] | None:
    """A completion of at most ``limit`` tokens from the matcher's state: ``previous`` when it
    still is one, else the matcher's own search (None: none within ``limit``)."""
    if previous is not None and len(previous) <= limit and guarded("constraint matcher", _completes, matcher, previous):
        return previous
    return guarded("constraint matcher", matcher.shortest_completion, limit)


def _completes(matcher, tokens: list[int]) -> bool:
    """``tokens`` are accepted from the current state and a stop token may follow them; the
    state is left unchanged."""
    taken = 0
    try:
        for token in tokens:
            if not matcher.accept_token(token):
                return False
            taken += 1
        if matcher.is_terminated():
            return True
        for stop in matcher.ctx.stop_token_ids:
            if matcher.accept_token(stop):
                taken += 1
                return True
        return False
    finally:
        matcher.rollback(taken)
