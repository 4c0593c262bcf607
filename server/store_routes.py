"""OpenAI's stored-completions and conversations endpoints over :class:`server.store.Store`.

The handlers find the store at ``app.state.store`` and the caller at ``server.auth.principal_of``;
every answer is OpenAI-shaped JSON and every failure an ``APIError`` (400/403/404/415/503). Bodies are
read by the handlers (errors name the field); :data:`BODY_STRUCTS` lists their wire types for the
OpenAPI document. ``GET /v1/chat/completions`` sits beside the app's ``POST`` on the same path.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from server.auth import principal_of
from server.errors import APIError, bad_request
from server.store import MAX_ITEMS_PER_REQUEST, Store, parse_items, validate_metadata
from server.store.store import check_limit, check_order

_JSON = "application/json"
_METADATA_PREFIX, _METADATA_SUFFIX = "metadata[", "]"
B = TypeVar("B")


class UpdateCompletionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /v1/chat/completions/{completion_id}``: the new metadata (null clears it)."""

    metadata: dict[str, str] | None


class CreateConversationBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /v1/conversations``."""

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class AppendItemsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /v1/conversations/{conversation_id}/items``."""

    items: list[dict[str, Any]]


BODY_STRUCTS: dict[tuple[str, str], type[msgspec.Struct]] = {
    ("/v1/chat/completions/{completion_id}", "post"): UpdateCompletionBody,
    ("/v1/conversations", "post"): CreateConversationBody,
    ("/v1/conversations/{conversation_id}/items", "post"): AppendItemsBody,
}


# --------------------------------------------------------------------------- request helpers


def _store(request: Request) -> Store:
    store = request.app.state.get("store")
    if store is None:
        raise APIError("stored completions and conversations are not enabled on this server", status=503,
                       code="store_unavailable")
    return store


def _user(request: Request) -> str:
    return principal_of(request).user


def _ok(body: dict[str, Any]) -> Response:
    return Response(content=msgspec.json.encode(body), media_type=_JSON)


def _query(request: Request, name: str) -> str | None:
    values = request.query_params.getall(name, [])
    if len(values) > 1:
        raise bad_request(f"'{name}' was given more than once", name)
    return values[0] if values else None


def _paging(request: Request, default_order: str) -> dict[str, Any]:
    """``after``, ``limit`` (1..100, default 20) and ``order`` from the query string."""
    limit_text = _query(request, "limit")
    try:
        limit = 20 if limit_text is None else int(limit_text)
    except ValueError:
        raise bad_request("limit must be an integer from 1 to 100", "limit") from None
    return {"after": _query(request, "after"), "limit": check_limit(limit),
            "order": check_order(_query(request, "order") or default_order)}


def _metadata_filter(request: Request) -> dict[str, str]:
    """``metadata[key]=value`` pairs of the query string."""
    pairs: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name.startswith(_METADATA_PREFIX) and name.endswith(_METADATA_SUFFIX):
            pairs[name[len(_METADATA_PREFIX):-len(_METADATA_SUFFIX)]] = value
    return validate_metadata(pairs, "metadata")


async def _body(request: Request, body_type: type[B]) -> B:
    content_type = request.headers.get("content-type")
    if content_type is not None and content_type.split(";", 1)[0].strip().lower() != _JSON:
        raise APIError(f"Content-Type must be {_JSON}", status=415, code="unsupported_media_type")
    raw = await request.body()
    try:
        return msgspec.json.decode(raw or b"{}", type=body_type)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid body: {exc}", _field_of(exc)) from None
    except msgspec.DecodeError:
        raise bad_request("the body is not valid JSON", code="invalid_json") from None


def _field_of(exc: msgspec.ValidationError) -> str | None:
    """``$.metadata.x`` in msgspec's message -> ``metadata`` (the offending top-level field)."""
    text = str(exc)
    if "`$." not in text:
        return None
    return text.split("`$.", 1)[1].split("`", 1)[0].split(".", 1)[0].split("[", 1)[0] or None


# --------------------------------------------------------------------------- stored chat completions


@get("/v1/chat/completions", summary="List stored chat completions")
async def list_chat_completions(request: Request) -> Response:
    model = _query(request, "model")
    page = await _store(request).list_completions(
        _user(request), model=model, metadata=_metadata_filter(request), **_paging(request, "asc"))
    return _ok(page.to_openai())


@get("/v1/chat/completions/{completion_id:str}", summary="Get a stored chat completion")
async def get_chat_completion(request: Request, completion_id: FromPath[str]) -> Response:
    stored = await _store(request).get_completion(_user(request), completion_id)
    return _ok(stored.to_openai())


@get("/v1/chat/completions/{completion_id:str}/messages", summary="Get a stored chat completion's messages")
async def get_chat_messages(request: Request, completion_id: FromPath[str]) -> Response:
    page = await _store(request).get_messages(_user(request), completion_id, **_paging(request, "asc"))
    return _ok(page.to_openai())


@post("/v1/chat/completions/{completion_id:str}", status_code=200, summary="Update a stored chat completion's metadata")
async def update_chat_completion(request: Request, completion_id: FromPath[str]) -> Response:
    body = await _body(request, UpdateCompletionBody)
    stored = await _store(request).update_metadata(_user(request), completion_id, body.metadata)
    return _ok(stored.to_openai())


@delete("/v1/chat/completions/{completion_id:str}", status_code=200, summary="Delete a stored chat completion")
async def delete_chat_completion(request: Request, completion_id: FromPath[str]) -> Response:
    await _store(request).delete_completion(_user(request), completion_id)
    return _ok({"object": "chat.completion.deleted", "id": completion_id, "deleted": True})


# --------------------------------------------------------------------------- conversations


@post("/v1/conversations", status_code=200, summary="Create a conversation")
async def create_conversation(request: Request) -> Response:
    body = await _body(request, CreateConversationBody)
    items = parse_items(body.items, "items", limit=MAX_ITEMS_PER_REQUEST)
    conversation = await _store(request).create_conversation(_user(request), body.metadata, items)
    return _ok(conversation.to_openai())


@get("/v1/conversations/{conversation_id:str}", summary="Get a conversation")
async def get_conversation(request: Request, conversation_id: FromPath[str]) -> Response:
    conversation = await _store(request).get_conversation(_user(request), conversation_id)
    return _ok(conversation.to_openai())


@get("/v1/conversations/{conversation_id:str}/items", summary="List a conversation's items")
async def list_conversation_items(request: Request, conversation_id: FromPath[str]) -> Response:
    page = await _store(request).list_items(_user(request), conversation_id, **_paging(request, "desc"))
    return _ok(page.to_openai())


@post("/v1/conversations/{conversation_id:str}/items", status_code=200, summary="Add items to a conversation")
async def append_conversation_items(request: Request, conversation_id: FromPath[str]) -> Response:
    body = await _body(request, AppendItemsBody)
    items = parse_items(body.items, "items", limit=MAX_ITEMS_PER_REQUEST)
    if not items:
        raise bad_request("items must not be empty", "items")
    added = await _store(request).append_items(_user(request), conversation_id, items)
    data = [item.to_openai() for item in added]
    return _ok({"object": "list", "data": data, "first_id": added[0].id, "last_id": added[-1].id, "has_more": False})


@delete("/v1/conversations/{conversation_id:str}", status_code=200, summary="Delete a conversation")
async def delete_conversation(request: Request, conversation_id: FromPath[str]) -> Response:
    await _store(request).delete_conversation(_user(request), conversation_id)
    return _ok({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


STORE_ROUTE_HANDLERS = [
    list_chat_completions,
    get_chat_completion,
    get_chat_messages,
    update_chat_completion,
    delete_chat_completion,
    create_conversation,
    get_conversation,
    list_conversation_items,
    append_conversation_items,
    delete_conversation,
]
"""Add to ``Litestar(route_handlers=[...])`` next to the generation routes."""
