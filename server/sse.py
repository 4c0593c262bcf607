"""Server-sent events in the OpenAI streaming format."""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()


def sse_event(payload: object) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def done_event() -> bytes:
    return b"data: [DONE]\n\n"


def stream_error_event(message: str, status: int = 500, code: str = "generation_error",
                       type: str = "internal_server_error", param: str | None = None) -> bytes:
    """An error after the stream started: the status line is already sent, so it travels as data."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return sse_event({"error": error})


def stream_api_error_event(error) -> bytes:
    """``stream_error_event`` for an :class:`server.errors.APIError`."""
    return stream_error_event(error.message, error.status, error.code, error.type, error.param)
