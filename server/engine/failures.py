"""How work done for one sequence fails without failing anything else.

Whatever runs for one sequence (its matcher, detokenizer, stop strings, a client's code) is
called through :func:`guarded`: an exception becomes a :class:`SequenceFailed` naming what
failed, which ends only that sequence with finish_reason "error".
"""

from __future__ import annotations

# how a sequence whose constraint hit a parser limit mid-generation fails (the client's constraint
# is too complex to follow at this point: a 400 naming it, not a server fault)
CONSTRAINT_LIMIT = "the constraint hit a parser limit mid-generation"
# how a sequence fails whose constraint backend did not return from a call within the bound
# (--constraint-call-timeout): its matcher is abandoned, as the client's constraint is likely what
# the backend cannot handle (a 400 naming it)
CONSTRAINT_TIMEOUT = "the constraint did not answer in time"


class SequenceFailed(Exception):
    """One sequence's own work failed; the message is what its client is told."""


def constraint_timeout(what: str, timeout_s: float) -> str:
    """The error of a sequence whose constraint did not return from ``what`` within ``timeout_s``."""
    return f"{CONSTRAINT_TIMEOUT}: {what} took over {timeout_s:g} s; the sequence was ended"


def describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def guarded(what: str, fn, *args):
    """``fn(*args)``, with any exception turned into a :class:`SequenceFailed` naming ``what``."""
    try:
        return fn(*args)
    except Exception as exc:
        raise SequenceFailed(f"{what} failed: {describe(exc)}") from exc
