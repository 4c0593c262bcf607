"""Nothing acknowledged is lost (issue #31, item 4), on SQLite and on PostgreSQL.

A real server process is killed (SIGKILL) while OpenAI SDK clients stream and fetch stored completions
and append turns to conversations. Restarted on the same database, every response a client received
whole (a stream whose ``data: [DONE]`` arrived, a non-streamed 200) reads back through the store's API
exactly as received, and nothing half-written is visible: no completion without its messages, no
conversation turn without its completion or the reverse, no trace of a stream cut off mid-way.

A PostgreSQL server stopped mid-request turns the requests that need the store into 503
``store_unavailable`` while plain ``store: false`` completions go on; once it is back, the store works again.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from server.config import Settings
from server.errors import APIError
from server.model_loader import ModelSource
from server.store import Store
from server.store.store import _sqlite_hooks, database_unavailable
from tests.conftest import free_port, start_server
from tests.server.store_fixtures import (  # noqa: F401
    PostgresServer,
    anyio_backend,
    postgres_server,
    private_postgres,
)

MODEL = "tiny"
KEY, USER = "sk-durable-0123456789", "dana"
REGULAR_CLIENTS = 4  # 0, 1: stored completions; 2, 3: conversation turns (each alternating stream / not)
ACKED_BEFORE_KILL = 2  # answers every regular client has in hand before the kill
VICTIM_TOKENS = 2000  # the stream cut off mid-way: far more tokens than can come before the kill
VICTIM_EVENTS_BEFORE_KILL = 40
DONE = "[DONE]"
TEMPLATE_TIMEOUT_S = 60.0  # the 2 s default refuses prompts on a crowded machine, which is not what is tested here
_STREAM_HEAD = ("id", "created", "model", "system_fingerprint")  # in every chunk, and in the whole response


# --------------------------------------------------------------------------- servers


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _keys_file(directory: Path) -> Path:
    keys = directory / "keys.txt"
    keys.write_text(f"{KEY} {USER}\n")
    return keys


def _serve_process(model_dir: Path, database_url: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """``python -m server.cli serve`` over ``database_url``, ready; its log is ``workdir/server.log``."""
    port = free_port()
    log_path = workdir / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRELLIS_LOG_LEVEL": "warning"}
    with open(log_path, "w") as log:  # a file, not a pipe: nobody reads it while the server runs
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
             "--port", str(port), "--max-batch-size", "8", "--database-url", database_url,
             "--api-keys-file", str(_keys_file(workdir)), "--template-timeout", str(TEMPLATE_TIMEOUT_S)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError("the server did not become ready")


@pytest.fixture
def server_process(tiny_model_dir, tmp_path) -> Iterator[Any]:
    """Starts a server process over a database (``start(url) -> (process, base URL)``); killed at the end."""
    started: list[subprocess.Popen] = []

    def start(database_url: str) -> tuple[subprocess.Popen, str]:
        proc, base = _serve_process(tiny_model_dir, database_url, tmp_path)
        started.append(proc)
        return proc, base

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextmanager
def _serving(model_dir: Path, database_url: str, workdir: Path) -> Iterator[str]:
    """A server in this process over ``database_url`` (quicker to start than a process): its base URL."""
    settings = Settings(model=str(model_dir), served_model_name=MODEL, max_batch_size=4,
                        api_keys_file=str(_keys_file(workdir)), database_url=database_url,
                        template_timeout=TEMPLATE_TIMEOUT_S)
    running, stop = start_server(settings, ModelSource(model_dir, name=MODEL))
    try:
        yield running.base_url
    finally:
        stop()


# --------------------------------------------------------------------------- clients


@dataclass
class Turn:
    """One request a client sent, and the response it received whole (None: cut off or refused)."""

    client: int
    number: int
    stream: bool
    conversation: str | None
    max_tokens: int = 8
    response: dict[str, Any] | None = None
    error: BaseException | None = None
    failed_before_kill: bool = False

    @property
    def text(self) -> str:
        return f"client {self.client} says {self.number}"

    @property
    def metadata(self) -> dict[str, str]:
        return {"client": str(self.client), "number": str(self.number)}


@dataclass
class Clients:
    """The clients' threads and everything they sent."""

    kill_started: threading.Event = field(default_factory=threading.Event)
    victim_events: list[str] = field(default_factory=list)  # the long stream's events so far
    turns: list[Turn] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, target, *args: Any) -> None:
        thread = threading.Thread(target=target, args=(self, *args), daemon=True)
        thread.start()
        self.threads.append(thread)

    def acked(self, client: int) -> int:
        return sum(1 for turn in self.turns if turn.client == client and turn.response is not None)

    def failures_before_kill(self) -> list[BaseException | None]:
        return [turn.error for turn in self.turns if turn.failed_before_kill]


def _request(turn: Turn) -> dict[str, Any]:
    extra: dict[str, Any] = {"ignore_eos": True}
    if turn.conversation is not None:
        extra["conversation"] = turn.conversation
    return {"model": MODEL, "messages": [{"role": "user", "content": turn.text}], "max_tokens": turn.max_tokens,
            "store": True, "metadata": turn.metadata, "extra_body": extra}


def _streamed(client: openai.OpenAI, turn: Turn, events: list[str] | None = None) -> dict[str, Any]:
    """The response assembled from the stream's chunks (its events also go to ``events``); raises
    unless ``data: [DONE]`` arrived."""
    events = [] if events is None else events
    with client.chat.completions.with_streaming_response.create(
            **_request(turn), stream=True, stream_options={"include_usage": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    if not events or events[-1] != DONE:
        raise ConnectionError(f"the stream ended without {DONE}")
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        raise RuntimeError(f"the stream carried an error: {chunks}")
    return _assembled(chunks)


def _assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client keeps of a streamed answer: the head fields, the message, its finish and the usage."""
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    head = {key: chunks[0][key] for key in _STREAM_HEAD}
    return {**head, "role": choices[0]["delta"]["role"],
            "content": "".join(choice["delta"].get("content") or "" for choice in choices),
            "finish_reason": choices[-1]["finish_reason"], "usage": chunks[-1]["usage"]}


def _whole(client: openai.OpenAI, turn: Turn) -> dict[str, Any]:
    """A non-streamed response's body exactly as received (the SDK raises on anything but a 2xx)."""
    return json.loads(client.chat.completions.with_raw_response.create(**_request(turn)).text)


def _send(clients: Clients, client: openai.OpenAI, turn: Turn) -> bool:
    """Send ``turn``, recording what came back; False once it failed."""
    clients.turns.append(turn)
    try:
        turn.response = _streamed(client, turn) if turn.stream else _whole(client, turn)
    except Exception as exc:  # the kill cuts requests off in many ways (reset, refused, incomplete chunk)
        turn.error, turn.failed_before_kill = exc, not clients.kill_started.is_set()
        return False
    return True


def _regular_client(clients: Clients, base_url: str, index: int, conversation: str | None) -> None:
    """Short stored requests, one after another, alternating streamed and not, until one fails."""
    with _client(base_url) as client:
        number = 0
        while _send(clients, client, Turn(index, number, number % 2 == 0, conversation)):
            number += 1


def _victim(clients: Clients, base_url: str, turn: Turn) -> None:
    """A long streamed turn, its events counted as they come."""
    clients.turns.append(turn)
    with _client(base_url) as client:
        try:
            turn.response = _streamed(client, turn, clients.victim_events)
        except Exception as exc:
            turn.error = exc


def _wait_for(condition, what: str, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- reading the store back


def _stored(client: openai.OpenAI, completion_id: str) -> dict[str, Any]:
    return json.loads(client.chat.completions.with_raw_response.retrieve(completion_id).text)


def _as_received(stored: dict[str, Any], streamed: bool) -> dict[str, Any]:
    """A stored completion as its client received it: the body without the store's fields, or what a
    client keeps of a stream."""
    body = {key: value for key, value in stored.items() if key not in ("metadata", "tags")}
    if not streamed:
        return body
    choice = body["choices"][0]
    return {**{key: body[key] for key in _STREAM_HEAD}, "role": choice["message"]["role"],
            "content": choice["message"]["content"], "finish_reason": choice["finish_reason"], "usage": body["usage"]}


def _items(client: openai.OpenAI, conversation: str) -> list[tuple[str, str]]:
    """A conversation's items as (role, text), oldest first (every item here is a text message)."""
    items = client.conversations.items.list(conversation, order="asc", limit=100)
    return [(item.role, "".join(part.text for part in item.content)) for item in items]


def _check_completion(client: openai.OpenAI, turn: Turn, stored: dict[str, Any]) -> None:
    """A stored completion is whole: its metadata, its one input message, and an answer with a finish."""
    assert stored["metadata"] == turn.metadata
    messages = client.chat.completions.messages.list(stored["id"])
    assert [(m.role, m.content) for m in messages.data] == [("user", turn.text)]
    choice = stored["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and stored["usage"]["completion_tokens"] == turn.max_tokens
    if turn.response is not None:
        assert _as_received(stored, turn.stream) == turn.response, turn


def _check_store(client: openai.OpenAI, clients: Clients, conversations: dict[int, str],
                 first_items: list[tuple[str, str]]) -> None:
    """Every acknowledged turn stored as received; nothing else stored but whole in-flight turns."""
    stored = {c.id: _stored(client, c.id) for c in client.chat.completions.list(limit=100)}
    by_turn = {(s["metadata"]["client"], s["metadata"]["number"]): s for s in stored.values()}
    assert len(by_turn) == len(stored)
    last = {turn.client: turn for turn in clients.turns}  # each client's last turn: the one the kill may cut
    kept: dict[int, list[tuple[str, str]]] = {}
    for turn in clients.turns:
        found = by_turn.pop((str(turn.client), str(turn.number)), None)
        if turn.response is not None:
            assert found is not None, f"acknowledged but not stored: {turn}"
        if found is None:
            continue
        assert turn is last[turn.client] or turn.response is not None, f"stored although never answered: {turn}"
        _check_completion(client, turn, found)
        kept.setdefault(turn.client, []).extend(
            [("user", turn.text), ("assistant", found["choices"][0]["message"]["content"])])
    assert not by_turn, f"stored completions no client sent: {list(by_turn)}"
    for index, conversation in conversations.items():
        assert _items(client, conversation) == first_items + kept.get(index, []), f"conversation of client {index}"


# --------------------------------------------------------------------------- the kill


def _database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return str(tmp_path / "store.sqlite3")
    return request.getfixturevalue("postgres_server").create_database()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_killed_server_loses_nothing_it_acknowledged(backend, server_process, tiny_model_dir, tmp_path, request):
    database = _database(backend, tmp_path, request)
    proc, base_url = server_process(database)
    first_items = [("user", "remember this")]
    with _client(base_url) as client:
        conversations = {index: client.conversations.create(items=[{"role": "user", "content": "remember this"}]).id
                         for index in (2, 3, REGULAR_CLIENTS)}
    clients = Clients()
    for index in range(REGULAR_CLIENTS):
        clients.run(_regular_client, base_url, index, conversations.get(index))
    _wait_for(lambda: all(clients.acked(i) >= ACKED_BEFORE_KILL for i in range(REGULAR_CLIENTS))
              or clients.failures_before_kill(), "answers before the kill")
    victim = Turn(REGULAR_CLIENTS, 0, True, conversations[REGULAR_CLIENTS], max_tokens=VICTIM_TOKENS)
    clients.run(_victim, base_url, victim)
    # Some tokens into the long stream, so that the kill is not in step with the turns that were awaited.
    _wait_for(lambda: len(clients.victim_events) >= VICTIM_EVENTS_BEFORE_KILL or clients.failures_before_kill(),
              "the long stream")
    clients.kill_started.set()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for thread in clients.threads:
        thread.join(timeout=120)
    assert not clients.failures_before_kill()
    assert victim.response is None and victim.error is not None  # cut off mid-way

    with _serving(tiny_model_dir, database, tmp_path) as restarted, _client(restarted) as client:
        _check_store(client, clients, conversations, first_items)
        assert client.chat.completions.list(metadata=victim.metadata).data == []
        # Still writable after the crash: a new turn lands after the old ones.
        turn = Turn(2, 10_000, False, conversations[2])
        assert _send(clients, client, turn)
        assert _items(client, conversations[2])[-2:] == [("user", turn.text),
                                                         ("assistant", turn.response["choices"][0]["message"]["content"])]


# --------------------------------------------------------------------------- PostgreSQL stopped


def _unavailable(response: httpx.Response) -> bool:
    """A 503 ``store_unavailable`` in the project's error body."""
    body = response.json()
    error = body.get("error") or {}
    return (response.status_code == 503 and set(body) == {"error", "code", "message", "request_id"}
            and set(error) == {"message", "type", "param", "code"} and error["code"] == body["code"] == "store_unavailable"
            and error["type"] == "service_unavailable_error" and error["message"] == body["message"])


def _status_error(call) -> httpx.Response:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.response


def test_stopped_postgresql_gives_503_and_the_store_recovers(private_postgres: PostgresServer, tiny_model_dir, tmp_path):
    with _serving(tiny_model_dir, private_postgres.create_database(), tmp_path) as base_url, _client(base_url) as client:
        kept = _ask(client, store=True)
        conversation = client.conversations.create(items=[{"role": "user", "content": "remember this"}]).id
        _stop_mid_request(base_url, client, private_postgres)
        _check_refused_while_down(base_url, client, kept.id, conversation)
        private_postgres.start()
        assert [c.id for c in client.chat.completions.list()] == [kept.id]  # nothing of the failed requests
        again = _ask(client, store=True, extra_body={"conversation": conversation})
        assert client.chat.completions.retrieve(again.id).choices[0].message.content == again.choices[0].message.content
        roles = [item.role for item in client.conversations.items.list(conversation, order="asc")]
        assert roles == ["user", "user", "assistant"]


def _ask(client: openai.OpenAI, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}
    return client.chat.completions.create(**body)


def _stop_mid_request(base_url: str, client: openai.OpenAI, postgres: PostgresServer) -> None:
    """Stop PostgreSQL while a whole and a streamed stored request generate: the first is a 503, the
    second never reaches ``[DONE]``."""
    outcomes: dict[str, Any] = {}
    long = {"store": True, "max_tokens": 1000, "extra_body": {"ignore_eos": True}}  # far outlasts stopping PostgreSQL
    threads = [threading.Thread(target=_outcome, args=(outcomes, "whole", lambda: _ask(client, **long))),
               threading.Thread(target=_outcome, args=(outcomes, "stream",
                                                       lambda: list(_ask(client, stream=True, **long))))]
    for thread in threads:
        thread.start()
    _wait_for(lambda: "trellis_running_sequences 2.0" in httpx.get(base_url + "/metrics").text, "both running")
    postgres.stop("fast")
    for thread in threads:
        thread.join(timeout=300)
    assert isinstance(outcomes["whole"], openai.APIStatusError) and _unavailable(outcomes["whole"].response)
    assert isinstance(outcomes["stream"], openai.APIError)  # the SDK raised: cut off, not acknowledged


def _check_refused_while_down(base_url: str, client: openai.OpenAI, stored_id: str, conversation: str) -> None:
    """Every request that needs the store is a 503; generation without it goes on."""
    refused = [
        lambda: client.chat.completions.list(),
        lambda: client.chat.completions.retrieve(stored_id),
        lambda: client.conversations.create(),
        lambda: client.conversations.items.list(conversation),
        lambda: _ask(client, store=True),
        lambda: _ask(client, extra_body={"conversation": conversation}),
    ]
    for call in refused:
        assert _unavailable(_status_error(call))
    plain = {"store": False, "extra_body": {"ignore_eos": True}}
    assert _ask(client, **plain).choices[0].finish_reason == "length"
    assert list(_ask(client, stream=True, **plain))[-1].choices[0].finish_reason == "length"
    assert httpx.get(base_url + "/health").status_code == 200


def _outcome(outcomes: dict[str, Any], name: str, call) -> None:
    """Run ``call`` in a thread, keeping its result or its exception under ``name``."""
    try:
        outcomes[name] = call()
    except Exception as exc:
        outcomes[name] = exc


# --------------------------------------------------------------------------- which failures are a 503


async def _raised(store: Store, statement: str) -> BaseException:
    with pytest.raises(Exception) as info:
        async with store.transaction() as tx:
            await tx.conn.exec_driver_sql(statement)
    return info.value


@pytest.mark.anyio
async def test_only_an_unavailable_database_is_a_503(tmp_path):
    path = tmp_path / "store.sqlite3"
    await (await Store.open(path)).close()  # creates the schema
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}", connect_args={"timeout": 0})  # no busy wait
    _sqlite_hooks(engine)
    store = Store(engine)
    holder = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        wrong = await _raised(store, "SELEC 1")
        assert not isinstance(wrong, APIError) and not database_unavailable(wrong)  # a bug stays a 500
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.raises(APIError) as info:
            await store.create_conversation(USER)
        assert info.value.status == 503 and info.value.code == "store_unavailable"
    finally:
        holder.close()
        await store.close()
    for down in (ConnectionRefusedError(111, "refused"), asyncpg.exceptions.CannotConnectNowError("starting up"),
                 asyncpg.exceptions.AdminShutdownError("terminating"), asyncpg.exceptions.TooManyConnectionsError("full")):
        assert database_unavailable(down), down
    for wrong in (asyncpg.exceptions.UniqueViolationError("duplicate"), asyncpg.exceptions.UndefinedColumnError("no"),
                  ValueError("bug")):
        assert not database_unavailable(wrong), wrong
