"""Per-request context shared by the middleware, handlers and error handlers (contextvars)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

_request_id: ContextVar[str | None] = ContextVar("trellis_request_id", default=None)
_request_log: ContextVar[dict[str, Any] | None] = ContextVar("trellis_request_log", default=None)


def request_id() -> str | None:
    """The id of the request being handled (the client's ``x-request-id`` when it sent one)."""
    return _request_id.get()


def request_log() -> dict[str, Any]:
    """Fields for this request's log line; handlers add to it (a throwaway dict outside a request)."""
    fields = _request_log.get()
    return fields if fields is not None else {}


def begin_request(rid: str) -> dict[str, Any]:
    """Set the context for a new request; returns its (mutable) log fields."""
    fields: dict[str, Any] = {}
    _request_id.set(rid)
    _request_log.set(fields)
    return fields
