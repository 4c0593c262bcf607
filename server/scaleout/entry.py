"""The HTTP entry point of a scaled-out Trellis: a plain ASGI app served by Ray Serve's proxy.

Every request is forwarded whole (head and body) to an engine replica through the deployment handle,
whose request router (``router.py``) picks the replica from the request's affinity key; the
replica's ASGI messages are relayed back as they come, so streams stream. A request whose replica
fails before it started answering (died, unreachable, or 503 while draining / with a dead engine) is
sent again to another replica; a stream whose replica dies after it started ends with an SSE error
event and ``[DONE]``. ``/metrics`` merges every replica's metrics, each series labelled with its
``replica``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from server.config import Settings
from server.scaleout.keys import affinity_key
from server.scaleout.replica import REPLICA_HEADER
from server.sse import done_event, stream_error_event

log = logging.getLogger("trellis.scaleout")

_RETRY_STATUS = 503
_METRICS_TIMEOUT_S = 10.0
_JSON = b"application/json"


class EntryApp:
    """Forwards HTTP requests to engine replicas (``replicas``: a Ray Serve deployment handle)."""

    def __init__(self, replicas: Any, settings: Settings, app_name: str, retries: int = 3) -> None:
        self.replicas = replicas.options(stream=True)
        self.metrics_handle = replicas
        self.settings = settings
        self.app_name = app_name
        self.retries = retries
        self.retried = 0

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["path"] == "/metrics" and scope["method"] == "GET":
                await self._metrics(send)
            else:
                await self._forward(scope, await _read_body(receive), send)

    # ----------------------------------------------------------------- forwarding

    async def _forward(self, scope: dict, body: bytes, send) -> None:
        head = _head(scope)
        key = affinity_key(scope["method"], scope["path"], body)
        deadline = _deadline(self.settings)
        excluded: str | None = None
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            stream = self.replicas.handle.remote(head, body, routing_key=key, exclude_replica=excluded)
            try:
                start = await _first_message(stream, deadline)
            except TimeoutError:
                stream.cancel()
                await _send_error(send, head, 504, "no replica answered within the request timeout", "request_timeout")
                return
            except Exception as exc:  # the replica died or could not be reached before answering
                log.warning("replica failed before answering (attempt %d): %r", attempt + 1, exc)
                if last:
                    await _send_error(send, head, 503, "no engine replica could take the request; retry later", "no_replica")
                    return
                await self._before_retry(attempt)
                continue
            replica = _header(start, REPLICA_HEADER)
            if start["status"] == _RETRY_STATUS and not last:
                stream.cancel()
                excluded = replica
                await self._before_retry(attempt)
                continue
            await send(_without_request_id(start))
            await _relay(stream, send, _is_event_stream(start))
            return

    async def _before_retry(self, attempt: int) -> None:
        self.retried += 1
        await asyncio.sleep(min(0.1 * 2**attempt, 2.0))

    # ----------------------------------------------------------------- metrics

    async def _metrics(self, send) -> None:
        """Every replica's metrics, each series labelled ``replica="<id>"``, plus the entry's own."""
        from server.scaleout.metrics_merge import merge_metrics

        texts = await self._replica_metrics()
        body = merge_metrics(texts, entry_gauges={
            "trellis_scaleout_replicas": ("engine replicas answering /metrics", len(texts)),
            "trellis_scaleout_retried_requests": ("requests sent again to another replica", self.retried),
        })
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                   (REPLICA_HEADER, ",".join(sorted(texts)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _replica_metrics(self) -> dict[str, bytes]:
        """{replica id: its Prometheus text} from every running replica (those that answer in time)."""
        try:
            answers = await self.metrics_handle.broadcast("metrics_text").results_async(
                timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            return {}
        return dict(answer for answer in answers if isinstance(answer, tuple))


# --------------------------------------------------------------------------- ASGI helpers


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _head(scope: dict) -> dict[str, Any]:
    """What a replica needs to rebuild the scope (picklable, small)."""
    return {
        "method": scope["method"],
        "path": scope["path"],
        "query_string": scope.get("query_string", b""),
        "headers": [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])],
        "client": list(scope["client"]) if scope.get("client") else None,
        "server": list(scope["server"]) if scope.get("server") else None,
        "scheme": scope.get("scheme", "http"),
        "http_version": scope.get("http_version", "1.1"),
    }


def _deadline(settings: Settings) -> float | None:
    return time.monotonic() + settings.request_timeout if settings.request_timeout > 0 else None


async def _first_message(stream, deadline: float | None) -> dict:
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    return await asyncio.wait_for(stream.__anext__(), timeout)


def _header(message: dict, name: bytes) -> str | None:
    for key, value in message.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _is_event_stream(start: dict) -> bool:
    return (_header(start, b"content-type") or "").startswith("text/event-stream")


def _without_request_id(start: dict) -> dict:
    """Ray's proxy adds ``x-request-id`` (the same id the replica used: it put it in the request)."""
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"x-request-id"]
    return {**start, "headers": headers}


async def _relay(stream: AsyncIterator[dict], send, event_stream: bool) -> None:
    """The rest of the response; if the replica dies meanwhile, a stream ends with an error event."""
    finished = False
    try:
        async for message in stream:
            await send(message)
            finished = not message.get("more_body", False)
    except Exception as exc:
        if finished:
            return
        log.warning("replica failed while answering: %r", exc)
        tail = b""
        if event_stream:
            tail = stream_error_event("the engine replica serving this stream failed; retry the request",
                                      status=503, code="replica_failed") + done_event()
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return
    if not finished:
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_error(send, head: dict, status: int, message: str, code: str) -> None:
    """An OpenAI error body from the entry point itself (no replica answered)."""
    error = {"message": message, "type": "service_unavailable_error" if status == 503 else "timeout_error",
             "param": None, "code": code}
    request_id = _header(head, b"x-request-id")
    body = msgspec.json.encode({"error": error, "code": code, "message": message, "request_id": request_id})
    headers = [(b"content-type", _JSON), (REPLICA_HEADER, b"none")]
    if status == 503:
        headers.append((b"retry-after", b"5"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TrellisEntry:
    """The entry deployment class (``serve.ingress()`` late-binds the ASGI app it builds)."""

    def __init__(self, replicas: Any, settings: Settings, app_name: str) -> None:
        self._app = EntryApp(replicas, settings, app_name)

    def __serve_build_asgi_app__(self) -> EntryApp:
        return self._app
