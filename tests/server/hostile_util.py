"""Helpers shared by the hostile-input and fuzzing tests: raw posts, the error-body contract and an
"is the server still alive" probe.

The timeouts here are hang detectors only (a request that never answers fails the test instead of
blocking the suite); no test asserts a tight wall-clock bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

MODEL = "tiny"
HANG_TIMEOUT = 60.0  # seconds: only to turn a hang into a failure

_RETRY_AFTER = re.compile(r"^\s*\d+(\.\d+)?\s*$")


def encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def post(
    server,
    path: str,
    body: Any,
    *,
    content_type: str | None = "application/json",
    timeout: float = HANG_TIMEOUT,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST ``body`` (a JSON-able value, or raw bytes sent as they are)."""
    all_headers = dict(headers or {})
    if content_type is not None:
        all_headers["content-type"] = content_type
    return httpx.post(server.base_url + path, content=encode(body), headers=all_headers, timeout=timeout)


def chat_body(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, **fields}


def chat(server, *, timeout: float = HANG_TIMEOUT, **fields: Any) -> httpx.Response:
    return post(server, "/v1/chat/completions", chat_body(**fields), timeout=timeout)


def assert_error(
    response: httpx.Response,
    status: int | tuple[int, ...],
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """The whole error contract: status, OpenAI ``error`` object, top-level mirrors, request id."""
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, (response.status_code, response.text[:2000])
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict), body
    assert set(body) == {"error", "code", "message", "request_id"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert body["code"] == error["code"], body
    assert body["message"] == error["message"], body
    request_id = response.headers.get("x-request-id")
    assert request_id, response.headers
    assert body["request_id"] == request_id, (body["request_id"], request_id)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_not_server_error(response: httpx.Response) -> None:
    """No 5xx for anything a client sends; a 4xx must carry the full error body."""
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    if response.status_code >= 400:
        assert_error(response, response.status_code)


def assert_retry_after(response: httpx.Response) -> float:
    value = response.headers.get("retry-after")
    assert value is not None, f"429 without Retry-After: {dict(response.headers)}"
    assert _RETRY_AFTER.match(value), f"Retry-After is not a number of seconds: {value!r}"
    return float(value)


def assert_alive(server, *, timeout: float = HANG_TIMEOUT) -> None:
    """Liveness plus one small normal chat request answered in full."""
    health = httpx.get(server.base_url + "/health", timeout=timeout)
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "ok", health.text
    reply = chat(server, max_tokens=4, ignore_eos=True, timeout=timeout)
    assert reply.status_code == 200, reply.text[:2000]
    body = reply.json()
    assert body["choices"][0]["message"]["content"] is not None
    assert body["usage"]["completion_tokens"] == 4


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]
