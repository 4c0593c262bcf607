"""The Litestar application: routes, lifespan, request ids and error handlers."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from server.chat import prepare_chat, run_chat, stream_chat
from server.completions import prepare_completion, run_completion, stream_completion
from server.config import Settings
from server.errors import EXCEPTION_HANDLERS, APIError
from server.protocol import ModelCard, ModelList
from server.state import ServerState, build_state

_JSON = "application/json"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _server(state: State) -> ServerState:
    server = state.get("server")
    if server is None:
        raise APIError("the model is still loading", status=503, code="model_loading")
    return server


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _respond(request: Request, make: Awaitable[Any]) -> Response:
    """Await a non-streamed result, cancelling the work if the client disconnects first."""
    work = asyncio.ensure_future(make)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()  # closes the generation stream → aborts the sequences
        return Response(content=b"", status_code=499)
    return Response(content=msgspec.json.encode(work.result()), media_type=_JSON)


def _sse(events: AsyncIterator[bytes]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers=_SSE_HEADERS)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response | Stream:
    server = _server(state)
    job = await prepare_chat(server, await request.body())
    if job.req.stream:
        return _sse(stream_chat(server, job))
    return await _respond(request, run_chat(server, job))


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Response | Stream:
    server = _server(state)
    job = await prepare_completion(server, await request.body())
    if job.req.stream:
        return _sse(stream_completion(server, job))
    return await _respond(request, run_completion(server, job))


@get("/v1/models")
async def list_models(state: State) -> Response:
    server = _server(state)
    card = ModelCard(
        id=server.model_name, created=server.created, root=server.model_name, max_model_len=server.settings.max_model_len
    )
    return Response(content=msgspec.json.encode(ModelList(data=[card])), media_type=_JSON)


@get("/health")
async def health(state: State) -> Response:
    server = state.get("server")
    body = {"status": "ok" if server else "loading"}
    if server:
        body |= {"running": server.engine.num_running, "waiting": server.engine.num_waiting}
    return Response(content=msgspec.json.encode(body), media_type=_JSON, status_code=200 if server else 503)


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    """Give every HTTP response an ``x-request-id`` (the client's own, when it sent one)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = incoming or secrets.token_hex(16).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware


def create_app(settings: Settings, server: ServerState | None = None) -> Litestar:
    """App factory. With ``server`` given (tests), the lifespan neither loads nor closes a model."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        owned = server is None
        app.state.server = server or await asyncio.to_thread(build_state, settings)
        try:
            yield
        finally:
            if owned:
                app.state.server.close()

    return Litestar(
        route_handlers=[chat_completions, completions, list_models, health],
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[request_id_middleware],
        openapi_config=OpenAPIConfig(title="Trellis", version="0.1.0", path="/docs"),
        request_max_body_size=32 * 1024 * 1024,
        debug=False,
    )
