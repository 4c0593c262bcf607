"""Stored completions and conversations through the real server, with API keys: the OpenAI SDK stores,
lists and reads back; a conversation supplies the history and records the turn; users are isolated."""

from __future__ import annotations

import httpx
import openai
import pytest

from server.config import Settings
from server.model_loader import ModelSource
from tests.conftest import start_server
from tests.server.store_fixtures import postgres_server  # noqa: F401  (a private PostgreSQL server)

MODEL = "tiny"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def keyed_server(request, tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# two users\n{ALICE} alice\n{BOB} bob\n")
    if request.param == "sqlite":
        store = str(tmp_path_factory.mktemp("store") / "store.sqlite3")
    else:
        store = request.getfixturevalue("postgres_server").create_database()
    settings = Settings(model=str(tiny_model_dir), served_model_name=MODEL, max_batch_size=4,
                        api_keys_file=str(keys), database_url=store)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name=MODEL))
    yield running
    stop()


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def _get(server, key: str, path: str, **params) -> httpx.Response:
    return httpx.get(server.base_url + path, params=params, headers={"Authorization": f"Api-Key {key}"}, timeout=30)


def test_missing_or_wrong_key_is_401_and_probes_stay_open(keyed_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    missing = httpx.post(keyed_server.base_url + "/v1/chat/completions", json=body)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(keyed_server.base_url + "/v1/chat/completions", json=body,
                       headers={"Authorization": "Bearer sk-nope"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"]
    assert httpx.get(keyed_server.base_url + "/health").status_code == 200
    assert httpx.get(keyed_server.base_url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(keyed_server, "sk-nope").models.list()


def test_stored_completion_round_trip_and_isolation(keyed_server):
    alice = _client(keyed_server, ALICE)
    reply = alice.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Remember me"}], max_tokens=4, store=True,
        metadata={"topic": "memory"},
    )
    listed = _get(keyed_server, ALICE, "/v1/chat/completions", **{"metadata[topic]": "memory"}).json()
    assert [item["id"] for item in listed["data"]] == [reply.id]
    stored = _get(keyed_server, ALICE, f"/v1/chat/completions/{reply.id}").json()
    assert stored["choices"][0]["message"]["content"] == reply.choices[0].message.content
    messages = _get(keyed_server, ALICE, f"/v1/chat/completions/{reply.id}/messages").json()
    assert [m["content"] for m in messages["data"]] == ["Remember me"]
    assert _get(keyed_server, BOB, f"/v1/chat/completions/{reply.id}").status_code == 403
    assert _get(keyed_server, BOB, "/v1/chat/completions").json()["data"] == []


def test_conversation_supplies_history_and_records_the_turn(keyed_server):
    headers = {"Authorization": f"Bearer {ALICE}"}
    created = httpx.post(keyed_server.base_url + "/v1/conversations", headers=headers, json={
        "items": [{"type": "message", "role": "user", "content": "My name is Ada."}]}).json()
    conversation = created["id"]
    body = {"model": MODEL, "conversation": conversation, "store": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "What is my name?"}]}
    answer = httpx.post(keyed_server.base_url + "/v1/chat/completions", headers=headers, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    plain = httpx.post(keyed_server.base_url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "What is my name?"}]}).json()
    assert answer.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the history was prepended
    items = _get(keyed_server, ALICE, f"/v1/conversations/{conversation}/items", order="asc").json()["data"]
    assert [item["role"] for item in items] == ["user", "user", "assistant"]
    only_history = httpx.post(keyed_server.base_url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "conversation": {"id": conversation}, "max_tokens": 2})
    assert only_history.status_code == 200, only_history.text  # messages may be omitted
    foreign = httpx.post(keyed_server.base_url + "/v1/chat/completions", timeout=60,
                         headers={"Authorization": f"Bearer {BOB}"}, json={**body, "store": False})
    assert foreign.status_code == 403


def test_streamed_answer_is_stored_before_the_stream_ends(keyed_server):
    alice = _client(keyed_server, ALICE)
    chunks = list(alice.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream and keep"}], max_tokens=5, store=True,
        stream=True, metadata={"kind": "streamed"}, extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    listed = _get(keyed_server, ALICE, "/v1/chat/completions", **{"metadata[kind]": "streamed"}).json()["data"]
    assert len(listed) == 1 and listed[0]["id"] == chunks[0].id
    assert listed[0]["choices"][0]["message"]["content"] == text
