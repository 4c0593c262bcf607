"""How work done for one sequence fails without failing anything else.

Whatever runs for one sequence (its matcher, detokenizer, stop strings, a client's code) is
called through :func:`guarded`: an exception becomes a :class:`SequenceFailed` naming what
failed, which ends only that sequence with finish_reason "error".
"""

from __future__ import annotations

# how a sequence whose constraint hit a parser limit mid-generation fails (the client's constraint
# is too complex to follow at this point: a 400 naming it, not a server fault)
CONSTRAINT_LIMIT = "the constraint hit a parser limit mid-generation"


class SequenceFailed(Exception):
    """One sequence's own work failed; the message is what its client is told."""


def describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def guarded(what: str, fn, *args):
    """``fn(*args)``, with any exception turned into a :class:`SequenceFailed` naming ``what``."""
    try:
        return fn(*args)
    except Exception as exc:
        raise SequenceFailed(f"{what} failed: {describe(exc)}") from exc
