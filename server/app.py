"""The Litestar application: routes, lifespan, request envelope (ids, metrics, log), error handlers.

Every generation request goes through the same guard rails: 503 while loading, draining or with a
dead engine; 415 for a body that is not JSON; bounded preparation (render, compile) that is dropped
at once when the client goes away; 429 with ``Retry-After`` when the waiting queue is full or the
expected wait for a first token is over ``--max-queue-wait`` (checked before rendering); and a
deadline (``--request-timeout``) from arrival to the last token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from server.auth import AuthMiddleware, Authenticator, open_mode_warning
from server.chat import persist_chat, prepare_chat, run_chat, stream_chat
from server.completions import prepare_completion, run_completion, stream_completion
from server.config import Settings
from server.context import begin_request, request_log
from server.dialect import DROPPED_HEADER, PROVIDER, dropped_header_value, use_router_dialect
from server.engine.admission import QueueWaitExceeded
from server.engine.errors import EngineOverloaded
from server.engine_options import SERVICE_TIERS
from server.errors import EXCEPTION_HANDLERS, APIError
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.openapi_doc import document_bodies
from server.protocol import ModelCard, ModelList
from server.sse import done_event, stream_error_event
from server.state import ServerState, build_state
from server.store import Store
from server.store_routes import STORE_ROUTE_HANDLERS

_JSON = "application/json"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics",
           "/v0/chat/completions", "/v0/completions", "/v0/endpoints")
_STEP_STALL_S = 30.0
access_log = logging.getLogger("trellis.access")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# --------------------------------------------------------------------------- guard rails


def _loaded(state: State) -> ServerState:
    """The server state, or 503 while the model loads."""
    server: ServerState | None = state.get("server")
    if server is None:
        raise APIError("the model is still loading", status=503, code="model_loading",
                       headers={"Retry-After": "5"})
    return server


def _serving(state: State) -> ServerState:
    """The server state, or 503 while loading, draining, or after the engine died."""
    server = _loaded(state)
    if server.draining:
        raise APIError("the server is shutting down", status=503, code="server_draining")
    if not server.engine.alive:
        raise APIError("the engine has stopped; the server is restarting", status=503, code="engine_dead")
    return server


def _require_json(request: Request) -> None:
    """415 for a body that says it is not JSON (a missing Content-Type is read as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != _JSON:
        raise APIError(f"Content-Type must be {_JSON}, got {media_type or 'nothing'!r}", status=415,
                       code="unsupported_media_type")


def _deadline(server: ServerState) -> float | None:
    timeout = server.settings.request_timeout
    return time.monotonic() + timeout if timeout > 0 else None


def _timeout_error(server: ServerState) -> APIError:
    return APIError(f"the request exceeded the server's {server.settings.request_timeout:g} s limit",
                    status=504, code="request_timeout", type="timeout_error")


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _guarded(request: Request, server: ServerState, work: Awaitable[Any], deadline: float | None) -> Any:
    """Await ``work`` unless the client disconnects (ClientGone) or the deadline passes (504)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()  # closes a generation stream → aborts its sequences
    if watch.done():
        raise ClientGone()
    raise _timeout_error(server)


def _note_request(server: ServerState, req, body: bytes) -> None:
    """The request's log fields: model, router fields, tags (also counted) and, when asked, its body."""
    fields = request_log()
    fields.update(model=server.model_name, stream=bool(req.stream))
    for name in ("signature", "region", "use_custom_keys", "user"):
        if getattr(req, name, None) is not None:
            fields[name] = getattr(req, name)
    if req.tags:
        fields["tags"] = list(req.tags)
        for tag in req.tags:
            server.metrics.tagged.labels(tag=server.metrics.tag_labels(tag)).inc()
    log_query = req.log_query_body if req.log_query_body is not None else server.settings.log_bodies
    log_response = req.log_response_body if req.log_response_body is not None else server.settings.log_bodies
    if log_query:
        fields["query_body"] = body[:_LOGGED_BODY_BYTES].decode("utf-8", "replace")
    if log_response:
        fields["log_response_body"] = True


def _note_admitted(server: ServerState, job) -> None:
    tokens = sum(len(spec.prompt_token_ids) for spec in job.specs)
    server.metrics.prompt_tokens.inc(tokens)
    request_log().update(prompt_tokens=tokens, sequences=len(job.specs))


def _open_stream(server: ServerState, job, stream: Callable[..., AsyncIterator[bytes]], deadline: float | None) -> Stream:
    """Queue the sequences before the 200 goes out (so a full queue is still a 429), and abort them
    if the response never iterates its events (the client left before the first chunk)."""
    generation = server.start_generation(job.request_id, job.specs)
    events = _bounded_events(server, stream(server, job, generation), deadline)
    weakref.finalize(events, generation.close)
    return Stream(events, media_type="text/event-stream", headers=_SSE_HEADERS)


def _overloaded(server: ServerState, exc: EngineOverloaded) -> APIError:
    waited_too_long = isinstance(exc, QueueWaitExceeded)
    server.metrics.rejected.labels(reason="queue_wait" if waited_too_long else "queue_full").inc()
    retry = max(1, int(round(exc.retry_after)))
    return APIError(f"the server is busy ({exc}); retry after {retry} s", status=429,
                    code="queue_wait_exceeded" if waited_too_long else "server_overloaded",
                    headers={"Retry-After": str(retry)})


class _Tier(msgspec.Struct):
    service_tier: str | None = None


def _service_tier(body: bytes) -> str | None:
    """The body's ``service_tier`` read on its own, before the request is parsed; None where it
    is missing or invalid (the full parse then answers the 400)."""
    try:
        tier = msgspec.json.decode(body, type=_Tier).service_tier
    except (msgspec.DecodeError, RecursionError):  # a body nested too deep is the full parse's 400
        return None
    return tier if tier in SERVICE_TIERS else None


async def _bounded_events(server: ServerState, events: AsyncIterator[bytes], deadline: float | None):
    """SSE events until done or the deadline (then an error event)."""
    iterator = aiter(events)
    try:
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(anext(iterator), timeout)
            except StopAsyncIteration:
                return
            except TimeoutError:
                error = _timeout_error(server)
                yield stream_error_event(error.message, code=error.code)
                yield done_event()
                return
            yield event
    finally:
        await iterator.aclose()


async def _generate(
    request: Request,
    state: State,
    prepare: Callable[[ServerState, bytes], Awaitable[Any]],
    run: Callable[[ServerState, Any], Awaitable[Any]],
    stream: Callable[..., AsyncIterator[bytes]],
    persist: Callable[[ServerState, Any, Any], Awaitable[None]] | None = None,
) -> Response | Stream:
    server = _serving(state)
    _require_json(request)
    deadline = _deadline(server)
    try:
        server.engine.check_admission(1, 0)  # a full queue refuses before any rendering or compiling
    except EngineOverloaded as exc:
        raise _overloaded(server, exc) from None
    body = await request.body()
    try:
        ticket = server.enter_queue(_service_tier(body))  # a long expected wait refuses before rendering too
    except EngineOverloaded as exc:
        raise _overloaded(server, exc) from None
    try:
        return await _admitted(request, server, body, deadline, prepare, run, stream, persist)
    finally:
        ticket.release()


async def _admitted(request: Request, server: ServerState, body: bytes, deadline: float | None, prepare, run,
                    stream, persist) -> Response | Stream:
    """Prepare and run (or open the stream of) a request that admission let in."""
    try:
        job = await _guarded(request, server, prepare(server, body), deadline)
        _note_request(server, job.req, body)
        if job.req.stream:
            stream_response = _open_stream(server, job, stream, deadline)
            _note_admitted(server, job)
            return stream_response
        result = await _guarded(request, server, run(server, job), deadline)
        _note_admitted(server, job)
        if persist is not None:
            await persist(server, job, result)  # stored before the response is sent
    except ClientGone:
        request_log().update(client_gone=True)
        return Response(content=b"", status_code=499)
    except EngineOverloaded as exc:
        raise _overloaded(server, exc) from None
    return Response(content=msgspec.json.encode(result), media_type=_JSON)


# --------------------------------------------------------------------------- routes


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(request: Request, state: State) -> Response | Stream:
    return await _generate(request, state, prepare_chat, run_chat, stream_chat, persist_chat)


@post("/v1/completions", status_code=200, summary="Create a text completion")
async def completions(request: Request, state: State) -> Response | Stream:
    return await _generate(request, state, prepare_completion, run_completion, stream_completion)


@post("/v0/chat/completions", status_code=200, summary="Create a chat completion (the router's dialect: drop_params on)")
async def router_chat_completions(request: Request, state: State) -> Response | Stream:
    use_router_dialect()
    return await _generate(request, state, prepare_chat, run_chat, stream_chat, persist_chat)


@post("/v0/completions", status_code=200, summary="Create a text completion (the router's dialect)")
async def router_completions(request: Request, state: State) -> Response | Stream:
    use_router_dialect()
    return await _generate(request, state, prepare_completion, run_completion, stream_completion)


@get("/v0/endpoints", summary="The model@provider endpoints this server answers (LoRA adapters included)")
async def router_endpoints(state: State) -> list[str]:
    server = _loaded(state)
    providers = [PROVIDER, *sorted(server.provider_aliases)]
    adapters = [a.name for a in server.lora.adapters] if server.lora is not None else []
    return [f"{model}@{provider}" for model in (server.model_name, *adapters) for provider in providers]


@get("/v1/models", summary="List the served model")
async def list_models(state: State) -> ModelList:
    server = _loaded(state)
    card = ModelCard(
        id=server.model_name, created=server.created, root=server.model_name, max_model_len=server.settings.max_model_len
    )
    adapters = server.lora.adapters if server.lora is not None else []
    cards = [ModelCard(id=a.name, created=server.created, root=str(a.path), parent=server.model_name,
                       max_model_len=server.settings.max_model_len) for a in adapters]
    return ModelList(data=[card, *cards])


@get("/health", summary="Liveness: 200 while the engine thread lives")
async def health(state: State) -> Response:
    server: ServerState | None = state.get("server")
    if server is None:
        return _json({"status": "loading"}, 503)
    engine = server.engine
    body = {"status": "ok" if engine.alive else "dead", "running": engine.num_running, "waiting": engine.num_waiting}
    if not engine.alive:
        body["error"] = str(engine.error)
    return _json(body, 200 if engine.alive else 503)


@get("/ready", summary="Readiness: model loaded, engine stepping, not draining")
async def ready(state: State) -> Response:
    server: ServerState | None = state.get("server")
    if server is None:
        return _json({"status": "loading"}, 503)
    engine = server.engine
    reasons = []
    if not engine.alive:
        reasons.append("engine dead")
    elif time.monotonic() - engine.last_step_at > _STEP_STALL_S:
        reasons.append("engine not stepping")
    if server.draining:
        reasons.append("draining")
    return _json({"status": "ready" if not reasons else "not ready", "reasons": reasons}, 503 if reasons else 200)


@get("/metrics", summary="Prometheus metrics", media_type=METRICS_CONTENT_TYPE)
async def metrics(state: State) -> Response:
    server: ServerState | None = state.get("server")
    if server is None:
        return _json({"status": "loading"}, 503)
    return Response(content=server.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _default_store_path():
    from server.model_loader import cache_root

    return cache_root() / "store.sqlite3"


def _json(body: dict, status: int) -> Response:
    return Response(content=msgspec.json.encode(body), media_type=_JSON, status_code=status)


# --------------------------------------------------------------------------- request envelope


class Envelope:
    """ASGI middleware: request id, in-flight count, per-route metrics and one log line per request."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.inflight = 0
        self.server: ServerState | None = None

    def __call__(self, app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            await self._handle(app, scope, receive, send)

        return middleware

    async def _handle(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = incoming.decode("latin-1")[:128] if incoming else secrets.token_hex(16)
        fields = begin_request(rid)
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(b"x-request-id", rid.encode("latin-1"))]
                if fields.get("dropped_params"):
                    extra.append((DROPPED_HEADER.encode(), dropped_header_value(fields["dropped_params"])))
                if fields.get("ignored_params"):  # accepted, but no effect on this model (server/reasoning.py)
                    extra.append((b"x-trellis-ignored", dropped_header_value(fields["ignored_params"])))
                if fields.get("truncated_prompt_tokens"):
                    extra.append((b"x-trellis-truncated-prompt-tokens", str(fields["truncated_prompt_tokens"]).encode()))
                if fields.get("clamped_max_tokens"):  # requested->used, one per distinct clamp
                    extra.append((b"x-trellis-clamped-max-tokens", ",".join(fields["clamped_max_tokens"]).encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            elif message["type"] == "http.response.body" and fields.get("log_response_body"):
                _capture_body(fields, message.get("body", b""))
            await send(message)

        self.inflight += 1
        try:
            await app(scope, receive, send_with_id)
        finally:
            self.inflight -= 1
            self._record(scope, status, time.monotonic() - started, rid, fields)

    def _record(self, scope: Scope, status: int, elapsed: float, rid: str, fields: dict) -> None:
        path = scope.get("path", "")
        route = _route_label(path)
        if self.server is not None:
            self.server.metrics.requests.labels(route=route, status=str(status)).inc()
            self.server.metrics.request_latency.labels(route=route).observe(elapsed)
        if self.settings.log_requests and route not in ("/health", "/ready", "/metrics"):
            line = {"request_id": rid, "method": scope.get("method"), "path": path, "status": status,
                    "duration_s": round(elapsed, 4), **fields}
            access_log.info(json.dumps(line, default=str))


_LOGGED_BODY_BYTES = 16384


def _capture_body(fields: dict, chunk: bytes) -> None:
    """Keep the first bytes of the response for the request's log line (log_response_body)."""
    kept = fields.setdefault("response_body", "")
    if len(kept) < _LOGGED_BODY_BYTES:
        fields["response_body"] = kept + chunk[: _LOGGED_BODY_BYTES - len(kept)].decode("utf-8", "replace")


def _route_label(path: str) -> str:
    """A bounded label set: ids in paths would make one time series per stored item."""
    if path in _ROUTES:
        return path
    if path.startswith("/v1/chat/completions/"):
        return "/v1/chat/completions/{id}"
    if path.startswith("/v1/conversations"):
        return "/v1/conversations"
    return "other"


# --------------------------------------------------------------------------- app factory


def create_app(settings: Settings, server: ServerState | None = None) -> Litestar:
    """App factory. With ``server`` given (tests, the CLI), the lifespan neither loads nor closes a model."""
    envelope = Envelope(settings)
    authenticator = Authenticator.from_settings(settings)
    warning = open_mode_warning(authenticator)
    if warning:
        logging.getLogger("trellis").warning(warning)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        owned = server is None
        app.state.server = server or await asyncio.to_thread(build_state, settings)
        app.state.envelope = envelope
        envelope.server = app.state.server
        app.state.store = app.state.server.store = await Store.open(settings.database_url or str(_default_store_path()))
        document_bodies(app)
        try:
            yield
        finally:
            await app.state.store.close()
            if owned:
                app.state.server.close()

    app = Litestar(
        route_handlers=[chat_completions, completions, router_chat_completions, router_completions, router_endpoints,
                        list_models, health, ready, metrics, *STORE_ROUTE_HANDLERS],
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[AuthMiddleware(authenticator)],
        openapi_config=OpenAPIConfig(title="Trellis", version="0.1.0", path="/docs"),
        request_max_body_size=settings.max_body_bytes,
        debug=False,
    )
    # Outside Litestar's router, so unknown routes and methods get a request id and a log line too.
    app.asgi_handler = envelope(app.asgi_handler)
    return app
