"""Why the engine refuses new work."""

from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine cannot take new sequences now (base class: answer 503)."""


class EngineOverloaded(EngineUnavailable):
    """The waiting queue is full; nothing of the request was queued.

    ``retry_after``: whole seconds (at least 1) after which the queue has likely made room,
    estimated from the recent admission rate.
    """

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class EngineDead(EngineUnavailable):
    """The engine thread has stopped (crashed or shut down); it will never run the request."""
