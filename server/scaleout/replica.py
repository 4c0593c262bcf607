"""The engine deployment: each Ray Serve replica runs today's single-server app in-process.

A replica builds the same ``ServerState`` (model, engine, compiler) and the same Litestar app as
``trellis serve``, enters the app's lifespan, and answers ``handle(head, body)`` by running one ASGI
request through that app and streaming its ASGI messages back to the entry point. So every route,
error body, status, header, auth check and metric is the single server's; the replica only adds an
``x-trellis-replica`` header naming itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from server.config import Settings
from server.model_loader import ModelSource

REPLICA_HEADER = b"x-trellis-replica"
log = logging.getLogger("trellis.scaleout")


def asgi_scope(head: dict[str, Any]) -> dict[str, Any]:
    """An HTTP ASGI scope from the request head the entry point forwards."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": head.get("http_version", "1.1"),
        "method": head["method"],
        "scheme": head.get("scheme", "http"),
        "path": head["path"],
        "raw_path": head["path"].encode("latin-1", "replace"),
        "root_path": "",
        "query_string": head.get("query_string", b""),
        "headers": [(bytes(name), bytes(value)) for name, value in head["headers"]],
        "client": tuple(head["client"]) if head.get("client") else None,
        "server": tuple(head["server"]) if head.get("server") else None,
    }


class TrellisReplica:
    """One model + engine + compiler, serving the single-server app (a Ray Serve deployment class)."""

    async def __init__(self, settings: Settings, source: ModelSource | None = None) -> None:
        from ray import serve

        from server.app import create_app
        from server.state import build_state

        logging.basicConfig(level=settings.log_level.upper())
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.state = await asyncio.to_thread(build_state, settings, source)
        self.app = create_app(settings, self.state)
        self._stop = asyncio.Event()
        started = asyncio.Event()
        self._lifespan = asyncio.create_task(self._run_lifespan(started))
        await asyncio.wait({self._lifespan, asyncio.ensure_future(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if self._lifespan.done():  # start-up failed: raise its error (Ray retries the replica)
            self._lifespan.result()
        log.info("replica %s serving %s", self.replica_id, self.state.model_name)

    async def handle(self, head: dict[str, Any], body: bytes, routing_key: str | None = None,
                     exclude_replica: str | None = None) -> AsyncIterator[dict]:
        """Run one HTTP request through the app; yields its ASGI ``http.response.*`` messages.

        ``routing_key`` and ``exclude_replica`` are read by the request router only. When the caller stops iterating (its
        client left), the app sees ``http.disconnect`` and the request's sequences are aborted.
        """
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica_id.encode())]}
            await messages.put(message)

        async def run() -> None:
            try:
                await self.app(asgi_scope(head), receive, send)
            finally:
                await messages.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await messages.get()) is not None:
                yield _coalesced(message, messages)
        finally:
            disconnected.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
                except (TimeoutError, asyncio.CancelledError):
                    task.cancel()

    async def metrics_text(self) -> tuple[str, bytes]:
        """(this replica's id, its Prometheus text), for the entry point's ``/metrics``."""
        return self.replica_id, self.state.metrics.render()

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine makes Ray replace the replica."""
        if not self.state.engine.alive:
            raise RuntimeError(f"the engine stopped: {self.state.engine.error}")

    async def _run_lifespan(self, started: asyncio.Event) -> None:
        """The app's lifespan (store opened, OpenAPI documented) in one task, entered and left there."""
        async with self.app.lifespan():
            started.set()
            await self._stop.wait()

    async def __del__(self) -> None:
        """Ray's graceful shutdown: leave the lifespan, then stop the engine and worker processes."""
        self._stop.set()
        try:
            await self._lifespan
        finally:
            await asyncio.to_thread(self.state.close)


def _coalesced(message: dict, queue: asyncio.Queue) -> dict:
    """Body chunks already waiting are sent as one message (fewer Ray object transfers).

    After the response start only body chunks and the end marker (None) arrive, so the end marker
    taken here is put back last, where it was."""
    if message["type"] != "http.response.body" or not message.get("more_body"):
        return message
    chunks = [message.get("body", b"")]
    more = True
    while more and not queue.empty():
        following = queue.get_nowait()
        if following is None:
            queue.put_nowait(None)
            break
        chunks.append(following.get("body", b""))
        more = following.get("more_body", False)
    return {"type": "http.response.body", "body": b"".join(chunks), "more_body": more}
