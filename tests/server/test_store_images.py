"""Image parts in the store (a SQLite file and a private PostgreSQL server): data URLs are stored once,
by content hash, as ``trellis-image:sha256:`` references; replaying a conversation resolves them back."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import time
from types import SimpleNamespace

import msgspec
import pytest
from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import create_async_engine

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.store import SCHEMA_VERSION, Store, conversation_messages, record, resolve_url
from server.store.images import REFERENCE_PREFIX, parse_data_url
from server.store.schema import (
    chat_completions,
    completion_messages,
    conversation_items,
    images,
    metadata,
    schema_version,
)
from tests.server.store_fixtures import anyio_backend, postgres_server, store, store_url  # noqa: F401

pytestmark = pytest.mark.anyio

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # bytes are bytes: the store does not decode images
PNG_B64 = base64.b64encode(PNG).decode()
PNG_URL = f"data:image/png;base64,{PNG_B64}"
PNG_DIGEST = hashlib.sha256(PNG).hexdigest()
PNG_REF = f"trellis-image:sha256:{PNG_DIGEST}"
HTTP_URL = "https://example.com/cat.png"


def _image(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def _response(completion_id: str, text: str = "a cat") -> dict:
    return {
        "id": completion_id, "object": "chat.completion", "created": 1_700_000_000, "model": "vlm",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def _count(store: Store, table) -> int:
    async with store.engine.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(table))).scalar()


async def _raw_rows(store: Store, table) -> str:
    """Every row of ``table`` as JSON text: what the database holds."""
    async with store.engine.connect() as conn:
        rows = (await conn.execute(select(table))).all()
    return msgspec.json.encode([list(row) for row in rows]).decode()


async def _image_rows(store: Store) -> list:
    async with store.engine.connect() as conn:
        return (await conn.execute(select(images.c.sha256, images.c.media_type, images.c.data))).all()


async def _record_turn(store: Store, conversation_id: str, content, completion_id: str, *, keep: bool = True):
    request = {"model": "vlm", "messages": [{"role": "user", "content": content}], "store": True}
    await record(store, "alice", request, _response(completion_id), store_completion=keep,
                 conversation_id=conversation_id, store_reasoning=True)


# --------------------------------------------------------------------------- stored completions


async def test_completion_stores_each_image_once_by_reference(store):
    content = [{"type": "text", "text": "Same picture twice?"}, _image(PNG_URL, "high"), _image(PNG_URL, "low"),
               _image(HTTP_URL), {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    request = {"model": "vlm", "store": True, "messages": [
        {"role": "system", "content": "Describe images."}, {"role": "user", "content": content}]}
    await record(store, "alice", request, _response("chatcmpl-img"), store_completion=True, conversation_id=None,
                 store_reasoning=True)

    rows = await _image_rows(store)
    assert [(row.sha256, row.media_type, bytes(row.data)) for row in rows] == [(PNG_DIGEST, "image/png", PNG)]
    for table in (chat_completions, completion_messages):
        raw = await _raw_rows(store, table)
        assert PNG_B64[:64] not in raw and "base64" not in raw  # no payload in the stored request or messages

    page = await store.get_messages("alice", "chatcmpl-img")
    parts = page.to_openai()["data"][1]["content_parts"]
    assert parts == [{"type": "text", "text": "Same picture twice?"}, _image(PNG_REF, "high"), _image(PNG_REF, "low"),
                     _image(HTTP_URL), content[4]]  # detail kept, http(s) and non-image parts as sent
    assert page.to_openai()["data"][0]["content"] == "Describe images."

    # another completion with the same image adds no row; a new image adds one
    other = base64.b64encode(b"GIF89a-other").decode()
    again = {"model": "vlm", "messages": [{"role": "user", "content": [_image(PNG_URL), _image(f"data:image/gif;base64,{other}")]}]}
    await store.save_completion("alice", "chatcmpl-img2", "vlm", again, _response("chatcmpl-img2"), {}, [],
                                again["messages"])
    assert sorted(row.sha256 for row in await _image_rows(store)) == sorted(
        [PNG_DIGEST, hashlib.sha256(b"GIF89a-other").hexdigest()])


async def test_unreadable_data_urls_are_stored_as_sent(store):
    odd = ["data:image/png;base64,not base64!!", "data:;base64,AAAA", "data:image/png;base64,", "ftp://x/y.png"]
    messages = [{"role": "user", "content": [_image(url) for url in odd]}]
    await store.save_completion("alice", "chatcmpl-odd", "vlm", {"messages": messages}, _response("chatcmpl-odd"),
                                {}, [], messages)
    assert await _count(store, images) == 0
    parts = (await store.get_messages("alice", "chatcmpl-odd")).data[0].message["content"]
    assert [part["image_url"]["url"] for part in parts] == odd


def test_parse_data_url():
    assert parse_data_url(PNG_URL).data == PNG
    assert parse_data_url(" DATA:Image/PNG;base64," + PNG_B64[:40] + "\n" + PNG_B64[40:]).media_type == "image/png"
    assert parse_data_url("data:image/svg+xml,%3Csvg%2F%3E").data == b"<svg/>"
    assert parse_data_url(HTTP_URL) is None and parse_data_url(None) is None
    assert parse_data_url("data:image/png;base64,QUJD\u00e9") is None


# --------------------------------------------------------------------------- conversations


async def test_conversation_turn_image_is_replayed_as_its_data_url(store):
    conversation = await store.create_conversation("alice", {}, [])
    await _record_turn(store, conversation.id, [{"type": "text", "text": "What is this?"}, _image(PNG_URL, "high")],
                       "chatcmpl-turn1")

    items = (await store.list_items("alice", conversation.id, order="asc")).to_openai()["data"]
    assert items[0]["content"] == [{"type": "input_text", "text": "What is this?"},
                                   {"type": "input_image", "image_url": PNG_REF, "detail": "high"}]
    assert PNG_B64[:64] not in await _raw_rows(store, conversation_items)

    history = await conversation_messages(store, "alice", conversation.id)
    assert history == [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image(PNG_URL, "high")]},
        {"role": "assistant", "content": "a cat"},
    ]

    # the chat route's replay: the stored turn comes before the request's own messages, as the renderer sees it
    from server.chat import _with_conversation

    await _record_turn(store, conversation.id, [_image(PNG_URL)], "chatcmpl-turn2")  # anonymous: no principal
    req = msgspec.convert({"model": "vlm", "conversation": conversation.id,
                           "messages": [{"role": "user", "content": "And now?"}]}, ChatCompletionRequest)
    with pytest.raises(APIError) as info:  # alice's conversation, and no principal is "anonymous"
        await _with_conversation(SimpleNamespace(store=store), req)
    assert info.value.status == 403
    mine = await store.create_conversation("anonymous", {}, [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": PNG_URL, "detail": "low"}]}])
    replayed = await _with_conversation(SimpleNamespace(store=store), msgspec.structs.replace(req, conversation=mine.id))
    assert [m.content for m in replayed.messages] == [[{"type": "text", "text": "Look"}, _image(PNG_URL, "low")],
                                                       "And now?"]
    assert await _count(store, images) == 1  # every turn and conversation shares the one row


async def test_conversations_api_items_keep_images_by_reference(store):
    conversation = await store.create_conversation("alice", {}, [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL}, {"type": "input_image",
                                                                                    "image_url": HTTP_URL}]}])
    added = await store.append_items("alice", conversation.id, [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL, "detail": "high"}]},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": PNG_URL}, {"type": "input_text", "text": "done"}]},
    ])
    assert added[0].content == [{"type": "input_image", "image_url": PNG_REF, "detail": "high"}]
    assert added[1].content["output"][0] == {"type": "input_image", "image_url": PNG_REF}
    items = (await store.list_items("alice", conversation.id, order="asc")).data
    assert [part["image_url"] for part in items[0].content] == [PNG_REF, HTTP_URL]
    assert await _count(store, images) == 1
    history = await conversation_messages(store, "alice", conversation.id)
    assert [part["image_url"]["url"] for part in history[0]["content"]] == [PNG_URL, HTTP_URL]
    assert history[1]["content"] == [_image(PNG_URL, "high")]


async def test_missing_image_is_a_400_naming_conversation_and_digest(store):
    conversation = await store.create_conversation("alice", {}, [])
    await _record_turn(store, conversation.id, [_image(PNG_URL)], "chatcmpl-gone", keep=False)
    async with store.transaction() as tx:
        await tx.conn.execute(delete(images))
    with pytest.raises(APIError) as info:
        await conversation_messages(store, "alice", conversation.id)
    error = info.value
    assert error.status == 400 and error.param == "conversation"
    assert conversation.id in str(error) and PNG_DIGEST in str(error)
    # the items themselves still list (with the reference)
    assert (await store.list_items("alice", conversation.id)).data[-1].content[0]["image_url"] == PNG_REF


async def test_large_and_concurrent_images(store):
    big = os.urandom(1_500_000)  # decoded, hashed and re-encoded off the event loop
    url = "data:image/webp;base64," + base64.b64encode(big).decode()
    conversation = await store.create_conversation("alice", {}, [])
    await asyncio.gather(*(_record_turn(store, conversation.id, [_image(url)], f"chatcmpl-big{i}") for i in range(3)))
    rows = await _image_rows(store)
    assert [(row.sha256, row.media_type, len(row.data)) for row in rows] == [
        (hashlib.sha256(big).hexdigest(), "image/webp", len(big))]
    history = await conversation_messages(store, "alice", conversation.id)
    user_turns = [m for m in history if m["role"] == "user"]
    assert len(user_turns) == 3 and all(m["content"] == [_image(url)] for m in user_turns)
    assert all(part["image_url"].startswith(REFERENCE_PREFIX)
               for item in (await store.list_items("alice", conversation.id)).data if item.role == "user"
               for part in item.content)


# --------------------------------------------------------------------------- opening an older database


async def test_old_database_without_images_table_opens_and_gains_it(store_url):
    engine = create_async_engine(resolve_url(store_url))
    older = [table for table in metadata.sorted_tables if table is not images]
    async with engine.begin() as conn:  # a version 1 database, as the previous server created it
        await conn.run_sync(lambda sync: metadata.create_all(sync, tables=older))
        await conn.execute(insert(schema_version).values(version=1, applied_at=int(time.time())))
    async with engine.connect() as conn:
        assert not await conn.run_sync(lambda sync: sync.dialect.has_table(sync, "images"))
    await engine.dispose()

    opened = await Store.open(store_url)
    try:
        async with opened.engine.connect() as conn:
            versions = (await conn.execute(select(schema_version.c.version).order_by(schema_version.c.version)))
            assert list(versions.scalars()) == list(range(1, SCHEMA_VERSION + 1))
        conversation = await opened.create_conversation("alice", {}, [
            {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL}]}])
        assert await _count(opened, images) == 1
        history = await conversation_messages(opened, "alice", conversation.id)
        assert history[0]["content"] == [_image(PNG_URL)]
    finally:
        await opened.close()
    reopened = await Store.open(store_url)  # and opens again at the new version
    await reopened.close()
