"""The store against real databases (a SQLite file and a private PostgreSQL server), and its HTTP
routes through the OpenAI SDK over a real server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from sqlalchemy import func, select, update

from server.auth import Authenticator
from server.errors import APIError
from server.store import (
    SCHEMA_VERSION,
    Store,
    StoreError,
    conversation_messages,
    record,
    resolve_url,
)
from server.store.schema import completion_messages, completion_metadata, conversation_items, schema_version
from tests.server.store_fixtures import anyio_backend, build_app, postgres_server, serve, store, store_url  # noqa: F401

pytestmark = pytest.mark.anyio


def _response(completion_id: str, text: str = "hello", created: int = 1_700_000_000, **message) -> dict:
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, **message},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


async def _save(store: Store, user: str, completion_id: str, *, model: str = "tiny", metadata=None, messages=None):
    messages = messages or [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = {"model": model, "messages": messages, "temperature": 0}
    return await store.save_completion(user, completion_id, model, request, _response(completion_id),
                                       metadata or {}, ["t1"], messages)


def _ids(page) -> list[str]:
    return [row.id for row in page.data]


async def _count(store: Store, table, **where) -> int:
    query = select(func.count()).select_from(table)
    for column, value in where.items():
        query = query.where(table.c[column] == value)
    async with store.engine.connect() as conn:
        return (await conn.execute(query)).scalar()


# --------------------------------------------------------------------------- stored completions


async def test_save_list_paginate_and_get(store):
    for i in range(5):
        await _save(store, "alice", f"chatcmpl-{i}")
    page = await store.list_completions("alice", limit=2)
    assert _ids(page) == ["chatcmpl-0", "chatcmpl-1"] and page.has_more
    page = await store.list_completions("alice", limit=2, after=page.last_id)
    assert _ids(page) == ["chatcmpl-2", "chatcmpl-3"] and page.has_more
    page = await store.list_completions("alice", limit=2, after=page.last_id)
    assert _ids(page) == ["chatcmpl-4"] and not page.has_more
    page = await store.list_completions("alice", order="desc", limit=3)
    assert _ids(page) == ["chatcmpl-4", "chatcmpl-3", "chatcmpl-2"] and page.has_more
    assert _ids(await store.list_completions("alice", order="desc", after="chatcmpl-1")) == ["chatcmpl-0"]
    body = (await store.list_completions("alice", limit=1)).to_openai()
    assert body["object"] == "list" and body["first_id"] == body["last_id"] == "chatcmpl-0" and body["has_more"]

    stored = await store.get_completion("alice", "chatcmpl-3")
    assert stored.request == {"model": "tiny", "temperature": 0}  # messages live in their own table
    assert stored.to_openai()["choices"][0]["message"]["content"] == "hello"
    assert stored.to_openai()["metadata"] == {} and stored.tags == ["t1"]


async def test_filters(store):
    await _save(store, "alice", "chatcmpl-a", metadata={"topic": "cats", "team": "x"})
    await _save(store, "alice", "chatcmpl-b", model="other", metadata={"topic": "dogs", "team": "x"})
    await _save(store, "alice", "chatcmpl-c", metadata={"topic": "cats", "team": "y"})
    assert _ids(await store.list_completions("alice", model="other")) == ["chatcmpl-b"]
    assert _ids(await store.list_completions("alice", metadata={"topic": "cats"})) == ["chatcmpl-a", "chatcmpl-c"]
    assert _ids(await store.list_completions("alice", metadata={"topic": "cats", "team": "y"})) == ["chatcmpl-c"]
    assert _ids(await store.list_completions("alice", model="other", metadata={"topic": "cats"})) == []
    assert _ids(await store.list_completions("alice", metadata={'we"ird\\key': "v"})) == []
    assert _ids(await store.list_completions("alice", model="ti\x00ny")) == []


async def test_messages(store):
    messages = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    messages.append({"role": "user", "content": [{"type": "text", "text": "part"}]})
    await _save(store, "alice", "chatcmpl-m", messages=messages)
    page = await store.get_messages("alice", "chatcmpl-m", limit=3)
    assert _ids(page) == ["chatcmpl-m-0", "chatcmpl-m-1", "chatcmpl-m-2"] and page.has_more
    page = await store.get_messages("alice", "chatcmpl-m", after=page.last_id)
    assert _ids(page) == ["chatcmpl-m-3", "chatcmpl-m-4"] and not page.has_more
    last = page.data[-1].to_openai()
    assert last["content"] == "part" and last["content_parts"] == [{"type": "text", "text": "part"}]
    assert page.data[0].to_openai() == {"id": "chatcmpl-m-3", "role": "user", "content": "m3", "content_parts": None}
    assert _ids(await store.get_messages("alice", "chatcmpl-m", order="desc", limit=2)) == ["chatcmpl-m-4", "chatcmpl-m-3"]
    with pytest.raises(APIError) as info:
        await store.get_messages("alice", "chatcmpl-m", after="chatcmpl-other-1")
    assert info.value.status == 400 and info.value.param == "after"


async def test_update_and_delete(store):
    await _save(store, "alice", "chatcmpl-u", metadata={"a": "1"})
    updated = await store.update_metadata("alice", "chatcmpl-u", {"b": "2"})
    assert updated.metadata == {"b": "2"}
    assert (await store.get_completion("alice", "chatcmpl-u")).metadata == {"b": "2"}
    assert _ids(await store.list_completions("alice", metadata={"a": "1"})) == []
    assert _ids(await store.list_completions("alice", metadata={"b": "2"})) == ["chatcmpl-u"]
    assert (await store.update_metadata("alice", "chatcmpl-u", None)).metadata == {}

    await store.update_metadata("alice", "chatcmpl-u", {"c": "3"})
    await store.delete_completion("alice", "chatcmpl-u")
    with pytest.raises(APIError) as info:
        await store.get_completion("alice", "chatcmpl-u")
    assert info.value.status == 404
    # Children went with it (foreign keys are on in SQLite too).
    assert await _count(store, completion_messages, completion_id="chatcmpl-u") == 0
    assert await _count(store, completion_metadata, completion_id="chatcmpl-u") == 0


async def test_users_only_touch_their_own_rows(store):
    await _save(store, "alice", "chatcmpl-private")
    conversation = await store.create_conversation("alice", {}, [{"role": "user", "content": "secret"}])
    attempts = [
        store.get_completion("bob", "chatcmpl-private"),
        store.get_messages("bob", "chatcmpl-private"),
        store.update_metadata("bob", "chatcmpl-private", {"x": "y"}),
        store.delete_completion("bob", "chatcmpl-private"),
        store.get_conversation("bob", conversation.id),
        store.list_items("bob", conversation.id),
        store.append_items("bob", conversation.id, [{"role": "user", "content": "x"}]),
        store.delete_conversation("bob", conversation.id),
        conversation_messages(store, "bob", conversation.id),
    ]
    for attempt in attempts:
        with pytest.raises(APIError) as info:
            await attempt
        assert info.value.status == 403 and info.value.code == "permission_denied"
    assert _ids(await store.list_completions("bob")) == []
    with pytest.raises(APIError) as info:
        await store.list_completions("bob", after="chatcmpl-private")
    assert info.value.status == 400
    # Nothing changed for alice.
    assert (await store.get_completion("alice", "chatcmpl-private")).metadata == {}
    assert len((await store.list_items("alice", conversation.id)).data) == 1
    for missing in ("chatcmpl-nope", "x" * 500, "a\x00b"):
        with pytest.raises(APIError) as info:
            await store.get_completion("alice", missing)
        assert info.value.status == 404


async def test_validation(store):
    await _save(store, "alice", "chatcmpl-v")
    bad_calls = [
        (store.list_completions("alice", limit=0), "limit"),
        (store.list_completions("alice", limit=101), "limit"),
        (store.list_completions("alice", order="sideways"), "order"),  # type: ignore[arg-type]
        (store.update_metadata("alice", "chatcmpl-v", {f"k{i}": "v" for i in range(17)}), "metadata"),
        (store.update_metadata("alice", "chatcmpl-v", {"k": "v" * 513}), "metadata"),
        (store.update_metadata("alice", "chatcmpl-v", {"k": 1}), "metadata"),  # type: ignore[dict-item]
        (store.create_conversation("alice", {}, [{"role": "wizard", "content": "x"}]), "items[0].role"),
        (store.create_conversation("alice", {}, [{"type": "web_search_call"}]), "items[0]"),
        (store.create_conversation("alice", {}, [{"role": "user", "content": 3}]), "items[0].content"),
    ]
    for call, param in bad_calls:
        with pytest.raises(APIError) as info:
            await call
        assert info.value.status == 400 and info.value.param == param


async def test_awkward_values_round_trip(store):
    """NUL characters and -inf logprobs must not break PostgreSQL's json/text columns."""
    response = _response("chatcmpl-odd", text="a\x00b")
    response["choices"][0]["logprobs"] = {"content": [{"token": "a", "logprob": float("-inf")}]}
    await store.save_completion("alice", "chatcmpl-odd", "tiny", {}, response, {}, [], [{"role": "user", "content": "\x00"}])
    stored = await store.get_completion("alice", "chatcmpl-odd")
    assert stored.response["choices"][0]["message"]["content"] == "a\x00b"
    assert stored.response["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    conversation = await store.create_conversation("alice", {}, [])
    await record(store, "alice", {"messages": [{"role": "user", "content": "q"}]},
                 _response("chatcmpl-odd2", reasoning_content="think\x00ing"),
                 store_completion=False, conversation_id=conversation.id, store_reasoning=True)
    items = (await store.list_items("alice", conversation.id, order="asc")).data
    assert items[1].reasoning == "think\ufffding"


# --------------------------------------------------------------------------- conversations


async def test_conversations(store):
    conversation = await store.create_conversation("alice", {"topic": "demo"}, [
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
    ])
    assert conversation.id.startswith("conv_")
    assert conversation.to_openai() == {"id": conversation.id, "object": "conversation",
                                        "created_at": conversation.created, "metadata": {"topic": "demo"}}
    assert (await store.get_conversation("alice", conversation.id)).metadata == {"topic": "demo"}
    added = await store.append_items("alice", conversation.id, [
        {"role": "assistant", "content": "calling"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ])
    assert [item.type for item in added] == ["message", "function_call", "function_call_output", "message"]
    assert added[1].to_openai() == {"type": "function_call", "id": added[1].id, "call_id": "call_1", "name": "weather",
                                    "arguments": '{"city":"Oslo"}', "status": "completed"}

    newest = await store.list_items("alice", conversation.id, limit=2)  # default order: newest first
    assert _ids(newest) == [added[3].id, added[2].id] and newest.has_more
    older = await store.list_items("alice", conversation.id, limit=10, after=newest.last_id)
    assert _ids(older)[:2] == [added[1].id, added[0].id] and len(older.data) == 4  # then the two created ones
    oldest = await store.list_items("alice", conversation.id, order="asc", limit=1)
    assert oldest.data[0].to_openai()["content"] == [{"type": "input_text", "text": "be brief"}]

    messages = await conversation_messages(store, "alice", {"id": conversation.id})
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]

    await store.delete_conversation("alice", conversation.id)
    for call in (store.get_conversation("alice", conversation.id), conversation_messages(store, "alice", conversation.id)):
        with pytest.raises(APIError) as info:
            await call
        assert info.value.status == 404
    assert await _count(store, conversation_items, conversation_id=conversation.id) == 0


async def test_concurrent_appends_get_distinct_positions(store):
    conversation = await store.create_conversation("alice", {}, [])
    await asyncio.gather(*(
        store.append_items("alice", conversation.id, [{"role": "user", "content": f"{i}-{j}"} for j in range(2)])
        for i in range(8)
    ))
    items = (await store.list_items("alice", conversation.id, order="asc", limit=100)).data
    assert len(items) == 16
    texts = [item.content[0]["text"] for item in items]
    for i in range(8):  # each append's two items stay adjacent and in order
        first = texts.index(f"{i}-0")
        assert texts[first + 1] == f"{i}-1"


# --------------------------------------------------------------------------- record + transactions


async def test_record_writes_completion_and_conversation_turn(store):
    conversation = await store.create_conversation("alice", {}, [{"role": "user", "content": "earlier"},
                                                                 {"role": "assistant", "content": "ok"}])
    history = await conversation_messages(store, "alice", conversation.id)
    request = {"model": "tiny", "messages": [*history, {"role": "user", "content": "now?"}],
               "metadata": {"run": "7"}, "tags": ["eval"], "store": True}
    response = _response("chatcmpl-rec", text="now!", reasoning_content="because")
    await record(store, "alice", request, response, store_completion=True, conversation_id=conversation.id,
                 store_reasoning=False)
    stored = await store.get_completion("alice", "chatcmpl-rec")
    assert stored.metadata == {"run": "7"} and stored.tags == ["eval"]
    assert "reasoning_content" not in stored.response["choices"][0]["message"]
    assert _ids(await store.get_messages("alice", "chatcmpl-rec")) == [f"chatcmpl-rec-{i}" for i in range(3)]
    assert (await conversation_messages(store, "alice", conversation.id))[-2:] == [
        {"role": "user", "content": "now?"}, {"role": "assistant", "content": "now!"}]

    await record(store, "alice", {"messages": [{"role": "user", "content": "why?"}]},
                 _response("chatcmpl-rec2", text="so", reasoning_content="thinking"),
                 store_completion=False, conversation_id=conversation.id, store_reasoning=True)
    last = (await store.list_items("alice", conversation.id, limit=1)).data[0]
    assert last.reasoning == "thinking"
    assert last.to_openai()["content"][0] == {"type": "reasoning_text", "text": "thinking"}
    assert (await conversation_messages(store, "alice", conversation.id))[-1] == {
        "role": "assistant", "content": "so", "reasoning_content": "thinking"}
    with pytest.raises(APIError):
        await store.get_completion("alice", "chatcmpl-rec2")  # store_completion=False stored nothing


async def test_crash_inside_a_transaction_leaves_nothing(store):
    conversation = await store.create_conversation("alice", {}, [])
    with pytest.raises(RuntimeError, match="boom"):
        async with store.transaction() as tx:
            await tx.save_completion("alice", "chatcmpl-half", "tiny", {}, _response("chatcmpl-half"), {"k": "v"}, [],
                                     [{"role": "user", "content": "hi"}])
            await tx.append_items("alice", conversation.id, [{"role": "user", "content": "hi"}])
            raise RuntimeError("boom")
    assert await _count(store, completion_messages, completion_id="chatcmpl-half") == 0
    assert await _count(store, completion_metadata, completion_id="chatcmpl-half") == 0
    assert await _count(store, conversation_items, conversation_id=conversation.id) == 0
    with pytest.raises(APIError):
        await store.get_completion("alice", "chatcmpl-half")

    # record(): the completion is written first, then the conversation turn fails (another user's
    # conversation) -> the whole record is rolled back.
    foreign = await store.create_conversation("bob", {}, [])
    with pytest.raises(APIError) as info:
        await record(store, "alice", {"messages": [{"role": "user", "content": "hi"}]}, _response("chatcmpl-rb"),
                     store_completion=True, conversation_id=foreign.id, store_reasoning=True)
    assert info.value.status == 403
    assert _ids(await store.list_completions("alice")) == []
    assert await _count(store, conversation_items, conversation_id=foreign.id) == 0


# --------------------------------------------------------------------------- opening


async def test_reopen_and_schema_version(store_url):
    first = await Store.open(store_url)
    await _save(first, "alice", "chatcmpl-keep")
    await first.close()
    second = await Store.open(store_url)
    try:
        assert _ids(await second.list_completions("alice")) == ["chatcmpl-keep"]
        assert await _count(second, schema_version) == 1
        async with second.transaction() as tx:
            await tx.conn.execute(update(schema_version).values(version=SCHEMA_VERSION + 1))
    finally:
        await second.close()
    with pytest.raises(StoreError, match="newer"):
        await Store.open(store_url)


def test_resolve_url(tmp_path):
    assert resolve_url(tmp_path / "a.db").render_as_string() == f"sqlite+aiosqlite:///{tmp_path}/a.db"
    assert resolve_url("sqlite:///x.db").drivername == "sqlite+aiosqlite"
    for url in ("postgresql://u:p@h/db", "postgres://u@h/db", "postgresql+asyncpg://u@h:5/db"):
        assert resolve_url(url).drivername == "postgresql+asyncpg"
    for bad in ("", "mysql://u@h/db"):
        with pytest.raises(StoreError):
            resolve_url(bad)


async def test_memory_store_takes_concurrent_transactions():
    store = await Store.open("sqlite://")
    scratch = store._scratch_dir
    try:
        conversation = await store.create_conversation("alice", {}, [])
        await asyncio.gather(*(store.append_items("alice", conversation.id, [{"role": "user", "content": str(i)}])
                               for i in range(6)))
        assert len((await store.list_items("alice", conversation.id)).data) == 6
    finally:
        await store.close()
    assert scratch is not None and not scratch.exists()


async def test_sqlite_pragmas(tmp_path):
    store = await Store.open(tmp_path / "p.db")
    try:
        async with store.engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA foreign_keys")).scalar() == 1
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
    finally:
        await store.close()


# --------------------------------------------------------------------------- HTTP


@pytest.fixture
def http_store(store_url):
    """A real server (API keys for alice and bob) over a store, seeded with alice's completions."""

    async def seed() -> None:
        seeded = await Store.open(store_url)
        for i in range(3):
            await _save(seeded, "alice", f"chatcmpl-h{i}", metadata={"n": str(i % 2)})
        await seeded.close()

    asyncio.run(seed())
    base, stop = serve(build_app(Authenticator({"sk-alice": "alice", "sk-bob": "bob"}), store_url))
    yield base
    stop()


@pytest.fixture
def sdk(http_store):
    """OpenAI SDK clients for the server, one per API key; closed at the end."""
    clients: list[openai.OpenAI] = []

    def client(key: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=http_store + "/v1", api_key=key, max_retries=0, timeout=10))
        return clients[-1]

    yield client
    for opened in clients:
        opened.close()


def test_stored_completions_api(http_store, sdk):
    alice = sdk("sk-alice")
    page = alice.chat.completions.list(limit=2)
    assert [c.id for c in page.data] == ["chatcmpl-h0", "chatcmpl-h1"] and page.has_more
    assert [c.id for c in alice.chat.completions.list()] == ["chatcmpl-h0", "chatcmpl-h1", "chatcmpl-h2"]  # auto-paging
    assert [c.id for c in alice.chat.completions.list(metadata={"n": "1"})] == ["chatcmpl-h1"]
    assert [c.id for c in alice.chat.completions.list(model="tiny", order="desc", limit=1).data] == ["chatcmpl-h2"]
    assert alice.chat.completions.list(model="nope").data == []

    stored = alice.chat.completions.retrieve("chatcmpl-h1")
    assert stored.choices[0].message.content == "hello" and stored.metadata == {"n": "1"}
    messages = alice.chat.completions.messages.list("chatcmpl-h1")
    assert [(m.id, m.content) for m in messages.data] == [("chatcmpl-h1-0", "be brief"), ("chatcmpl-h1-1", "hi")]
    assert alice.chat.completions.update("chatcmpl-h1", metadata={"n": "9"}).metadata == {"n": "9"}
    deleted = alice.chat.completions.delete("chatcmpl-h1")
    assert deleted.deleted and deleted.id == "chatcmpl-h1" and deleted.object == "chat.completion.deleted"
    with pytest.raises(openai.NotFoundError):
        alice.chat.completions.retrieve("chatcmpl-h1")

    bob = sdk("sk-bob")
    assert bob.chat.completions.list().data == []
    with pytest.raises(openai.PermissionDeniedError) as info:
        bob.chat.completions.retrieve("chatcmpl-h0")
    assert info.value.code == "permission_denied"
    with pytest.raises(openai.AuthenticationError):
        sdk("sk-mallory").chat.completions.list()
    # The generation route on the same path still answers POST.
    response = httpx.post(http_store + "/v1/chat/completions", json={}, headers={"Authorization": "Bearer sk-alice"})
    assert response.json() == {"object": "chat.completion"}


def test_conversations_api(sdk):
    alice = sdk("sk-alice")
    conversation = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello!"}],
                                              metadata={"topic": "demo"})
    assert conversation.object == "conversation" and conversation.metadata == {"topic": "demo"}
    assert alice.conversations.retrieve(conversation.id).id == conversation.id
    added = alice.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"type": "message", "role": "user", "content": "How are you?"},
    ])
    assert len(added.data) == 2 and added.first_id == added.data[0].id
    items = alice.conversations.items.list(conversation.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant", "user"]
    assert items.data[0].content[0].text == "Hello!"
    newest = alice.conversations.items.list(conversation.id, limit=1)
    assert newest.data[0].content[0].text == "How are you?" and newest.has_more

    bob = sdk("sk-bob")
    with pytest.raises(openai.PermissionDeniedError):
        bob.conversations.items.list(conversation.id)
    assert alice.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conversation.id)


def test_http_errors_are_openai_shaped(http_store):
    headers = {"Authorization": "Bearer sk-alice"}
    cases = [
        ("GET", "/v1/chat/completions?limit=0", None, 400, "limit"),
        ("GET", "/v1/chat/completions?limit=abc", None, 400, "limit"),
        ("GET", "/v1/chat/completions?order=up", None, 400, "order"),
        ("GET", "/v1/chat/completions?after=chatcmpl-missing", None, 400, "after"),
        ("GET", "/v1/chat/completions?limit=1&limit=2", None, 400, "limit"),
        ("POST", "/v1/chat/completions/chatcmpl-h0", {"metadata": {"k": 1}}, 400, "metadata"),
        ("POST", "/v1/chat/completions/chatcmpl-h0", {"metadata": {}, "extra": 1}, 400, None),
        ("POST", "/v1/chat/completions/chatcmpl-h0", b"{not json", 400, None),
        ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, 400, "items"),
        ("POST", "/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, 400, "items[0].role"),
        ("GET", "/v1/chat/completions/%00", None, 404, None),
        ("GET", "/v1/conversations/conv_missing/items", None, 404, None),
        ("DELETE", "/v1/conversations/conv_missing", None, 404, None),
    ]
    with httpx.Client(base_url=http_store, headers=headers, timeout=10) as client:
        for method, path, body, status, param in cases:
            content = body if isinstance(body, bytes) else None
            response = client.request(method, path, json=None if content else body, content=content)
            assert response.status_code == status, (method, path, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (path, error)
        response = client.post("/v1/conversations", content=b"{}", headers={"Content-Type": "text/plain"})
        assert response.status_code == 415


def test_routes_without_a_store_answer_503():
    base, stop = serve(build_app(Authenticator()))
    try:
        response = httpx.get(base + "/v1/chat/completions")
        assert response.status_code == 503 and response.json()["error"]["code"] == "store_unavailable"
    finally:
        stop()
