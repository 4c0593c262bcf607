"""The store: stored chat completions and conversations in SQLite (aiosqlite) or PostgreSQL (asyncpg).

Every public method runs in its own transaction; :meth:`Store.transaction` gives several operations
one transaction (``server.store.flow.record`` writes a completion and a conversation turn that way).
A user only reaches their own rows: another user's id answers 403 (the issue's choice: ids are
unguessable, so saying "not yours" leaks nothing a 404 would hide, and it tells an operator why).

Image parts are stored by reference (:mod:`server.store.images`): a ``data:`` URL in a stored message or
item becomes ``trellis-image:sha256:<hex>`` and its bytes one row of ``images``. The list and get
methods (and so the GET endpoints) return the reference URLs as stored; :meth:`Tx.all_messages`, which
feeds a conversation into a prompt, resolves them back into ``data:`` URLs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import msgspec
from sqlalchemy import Connection, Table, delete, event, exists, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Row, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql import Select

from server.errors import APIError, bad_request
from server.store import images as image_refs
from server.store import schema
from server.store.images import THREAD_THRESHOLD, Externalizer, StoredImage
from server.store.items import NewItem, items_to_messages, parse_item, validate_metadata, validate_tags
from server.store.schema import (
    SCHEMA_VERSION,
    chat_completions,
    completion_messages,
    completion_metadata,
    conversation_items,
    conversations,
    images,
)

Order = Literal["asc", "desc"]
MAX_LIMIT = 100
_ID_MAX = 100
T = TypeVar("T")

MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    2: lambda conn: images.create(conn, checkfirst=True),  # Store.open's create_all has made it already
}
"""Schema step ``n`` upgrades a version ``n - 1`` database; run in order inside the start-up transaction."""

log = logging.getLogger("trellis")

# SQLSTATE classes meaning "the server cannot serve now", not "this query is wrong": connection
# exceptions, insufficient resources (too many connections, disk full), shutting down / starting up.
_PG_UNAVAILABLE_STATES = ("08", "53", "57P")
# SQLite primary result codes of the same kind: BUSY, LOCKED, NOMEM, READONLY, IOERR, FULL, CANTOPEN.
_SQLITE_UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14})


class StoreError(RuntimeError):
    """The store cannot be opened (bad URL, newer schema than this server knows)."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    """A stored chat completion: the response as sent, plus the request, metadata and tags."""

    id: str
    user: str
    created: int
    model: str
    request: dict[str, Any]
    response: dict[str, Any]
    metadata: dict[str, str]
    tags: list[str]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``chat.completion`` object with its ``metadata``."""
        body = {**self.response, "metadata": self.metadata}
        if self.tags:
            body["tags"] = self.tags
        return body


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One input message of a stored completion; ``id`` is ``<completion id>-<position>``."""

    id: str
    message: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's stored message: text ``content``, and ``content_parts`` when parts were sent."""
        content = self.message.get("content")
        body = {"id": self.id, **self.message, "content_parts": None}
        if isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            body["content"] = "".join(texts) if texts else None
            body["content_parts"] = content
        return body


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation's header; its items are listed separately."""

    id: str
    user: str
    created: int
    metadata: dict[str, str]

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created, "metadata": self.metadata}


@dataclass(frozen=True, slots=True)
class Item:
    """A stored conversation item (``message``, ``function_call`` or ``function_call_output``)."""

    id: str
    type: str
    role: str | None
    content: Any
    reasoning: str | None
    created: int

    def to_openai(self) -> dict[str, Any]:
        """The Conversations API item; stored reasoning is a leading ``reasoning_text`` part."""
        if self.type != "message":
            return {"type": self.type, "id": self.id, **self.content, "status": "completed"}
        content = list(self.content)
        if self.reasoning is not None:
            content.insert(0, {"type": "reasoning_text", "text": self.reasoning})
        return {"type": "message", "id": self.id, "status": "completed", "role": self.role, "content": content}


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list and whether more follow it."""

    data: list[T]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return self.data[0].id if self.data else None  # type: ignore[attr-defined]

    @property
    def last_id(self) -> str | None:
        return self.data[-1].id if self.data else None  # type: ignore[attr-defined]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's cursor list: ``object``, ``data``, ``first_id``, ``last_id``, ``has_more``."""
        return {"object": "list", "data": [row.to_openai() for row in self.data],  # type: ignore[attr-defined]
                "first_id": self.first_id, "last_id": self.last_id, "has_more": self.has_more}


def new_id(prefix: str) -> str:
    """A fresh unguessable id such as ``conv_<48 hex>``."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _usable(object_id: Any) -> bool:
    """Ids we could have issued: short strings a database can compare (no NUL, valid UTF-8)."""
    if not isinstance(object_id, str) or not object_id or len(object_id) > _ID_MAX or "\x00" in object_id:
        return False
    try:
        object_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_limit(limit: int) -> int:
    """1..100, as OpenAI's list endpoints take."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    return limit


def check_order(order: str) -> Order:
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    return order  # type: ignore[return-value]


def store_unavailable() -> APIError:
    """The 503 for a request that needs a database which cannot be reached now."""
    return APIError("the store's database is unavailable; retry later", status=503, code="store_unavailable")


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot serve now (unreachable, connection lost, shutting down,
    locked, out of space) rather than that a statement is wrong."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig
    if isinstance(exc, OSError):  # connect() refused, reset or timed out (asyncpg raises these unwrapped)
        return True
    state = getattr(exc, "sqlstate", None)  # asyncpg's errors, unwrapped from connect() or adapted by SQLAlchemy
    if isinstance(state, str) and state.startswith(_PG_UNAVAILABLE_STATES):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and (code & 0xFF) in _SQLITE_UNAVAILABLE_CODES


def _not_found(kind: str, object_id: Any) -> APIError:
    return APIError(f"No {kind} found with id '{str(object_id)[:_ID_MAX]}'", status=404, code="not_found")


# --------------------------------------------------------------------------- one transaction


class Tx:
    """The store's operations on one open transaction (from :meth:`Store.transaction`)."""

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    async def _owned(self, table: Table, kind: str, user: str, object_id: str, *, lock: bool = False) -> Row:
        row = None
        if _usable(object_id):
            query = select(table).where(table.c.id == object_id)
            row = (await self.conn.execute(query.with_for_update() if lock else query)).first()
        if row is None:
            raise _not_found(kind, object_id)
        if row.user_id != user:
            raise APIError(f"the {kind} '{object_id}' belongs to another user", status=403, code="permission_denied")
        return row

    async def _page(self, query: Select, key: Any, cursor: Any, order: Order, limit: int) -> tuple[list[Row], bool]:
        if cursor is not None:
            query = query.where(key > cursor if order == "asc" else key < cursor)
        query = query.order_by(key.asc() if order == "asc" else key.desc()).limit(limit + 1)
        rows = (await self.conn.execute(query)).all()
        return rows[:limit], len(rows) > limit

    # ----------------------------------------------------------------- chat completions

    async def save_completion(
        self,
        user: str,
        completion_id: str,
        model: str,
        request: Mapping[str, Any],
        response: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        tags: Sequence[str] | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
    ) -> StoredCompletion:
        """Store a completion with its input messages (the request is kept without ``messages``)."""
        if not _usable(completion_id):
            raise bad_request("a stored completion needs a short string id", "id")
        meta, tag_list = validate_metadata(metadata), validate_tags(tags)
        created = int(response.get("created") or time.time())
        request_rest = {key: value for key, value in request.items() if key != "messages"}
        messages, found = await externalize_messages(messages)
        try:
            await self.conn.execute(insert(chat_completions).values(
                id=completion_id, user_id=user, created=created, model=model, request=request_rest,
                response=dict(response), meta=meta, tags=tag_list,
            ))
        except IntegrityError:
            raise APIError(f"a chat completion with id '{completion_id}' is already stored", status=409,
                           code="conflict") from None
        await self._write_metadata(completion_id, meta)
        await self.save_images(found)
        if messages:
            rows = [{"completion_id": completion_id, "position": i, "message": dict(m)} for i, m in enumerate(messages)]
            await self.conn.execute(insert(completion_messages), rows)
        return StoredCompletion(completion_id, user, created, model, request_rest, dict(response), meta, tag_list)

    async def _write_metadata(self, completion_id: str, meta: Mapping[str, str]) -> None:
        if meta:
            rows = [{"completion_id": completion_id, "key": key, "value": value} for key, value in meta.items()]
            await self.conn.execute(insert(completion_metadata), rows)

    async def list_completions(
        self,
        user: str,
        *,
        model: str | None = None,
        metadata: Mapping[str, str] | None = None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
    ) -> Page[StoredCompletion]:
        """The user's completions in creation order, optionally only one model's and matching all metadata pairs."""
        limit, order = check_limit(limit), check_order(order)
        table = chat_completions
        query = select(table).where(table.c.user_id == user)
        if model is not None:
            if "\x00" in model:  # never in a stored model name, and PostgreSQL cannot even compare it
                return Page([], False)
            query = query.where(table.c.model == model)
        for key, value in (metadata or {}).items():
            meta = completion_metadata.c
            query = query.where(exists().where(meta.completion_id == table.c.id, meta.key == key, meta.value == value))
        cursor = None
        if after is not None:
            found = select(table.c.seq).where(table.c.id == after, table.c.user_id == user)
            cursor = (await self.conn.execute(found)).scalar() if _usable(after) else None
            if cursor is None:
                message = f"'after' names no stored chat completion of yours: '{str(after)[:_ID_MAX]}'"
                raise bad_request(message, "after")
        rows, more = await self._page(query, table.c.seq, cursor, order, limit)
        return Page([_completion(row) for row in rows], more)

    async def get_completion(self, user: str, completion_id: str) -> StoredCompletion:
        """One stored completion (404 unknown, 403 another user's)."""
        return _completion(await self._owned(chat_completions, "chat completion", user, completion_id))

    async def get_messages(
        self, user: str, completion_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> Page[StoredMessage]:
        """A page of a stored completion's input messages."""
        limit, order = check_limit(limit), check_order(order)
        await self._owned(chat_completions, "chat completion", user, completion_id)
        cursor = None if after is None else _message_position(completion_id, after)
        table = completion_messages
        query = select(table).where(table.c.completion_id == completion_id)
        rows, more = await self._page(query, table.c.position, cursor, order, limit)
        return Page([StoredMessage(f"{completion_id}-{row.position}", row.message) for row in rows], more)

    async def update_metadata(
        self, user: str, completion_id: str, metadata: Mapping[str, str] | None
    ) -> StoredCompletion:
        """Replace a stored completion's metadata (None clears it)."""
        meta = validate_metadata(metadata)
        row = await self._owned(chat_completions, "chat completion", user, completion_id, lock=True)
        table = chat_completions
        await self.conn.execute(update(table).where(table.c.id == completion_id).values(meta=meta))
        await self.conn.execute(delete(completion_metadata).where(completion_metadata.c.completion_id == completion_id))
        await self._write_metadata(completion_id, meta)
        return StoredCompletion(row.id, row.user_id, row.created, row.model, row.request, row.response, meta, row.tags)

    async def delete_completion(self, user: str, completion_id: str) -> None:
        """Delete a stored completion and its messages."""
        await self._owned(chat_completions, "chat completion", user, completion_id, lock=True)
        await self.conn.execute(delete(chat_completions).where(chat_completions.c.id == completion_id))

    # ----------------------------------------------------------------- conversations

    async def create_conversation(
        self, user: str, metadata: Mapping[str, str] | None = None, items: Iterable[NewItem | Mapping[str, Any]] = ()
    ) -> Conversation:
        """A new conversation, optionally with its first items."""
        conversation = Conversation(new_id("conv"), user, int(time.time()), validate_metadata(metadata))
        new, found = await externalize_items(_new_items(items))
        await self.conn.execute(insert(conversations).values(
            id=conversation.id, user_id=user, created=conversation.created, meta=conversation.metadata,
        ))
        await self._insert_items(conversation.id, new, 0, found)
        return conversation

    async def get_conversation(self, user: str, conversation_id: str) -> Conversation:
        """A conversation's header (404 unknown, 403 another user's)."""
        row = await self._owned(conversations, "conversation", user, conversation_id)
        return Conversation(row.id, row.user_id, row.created, row.meta)

    async def list_items(
        self, user: str, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> Page[Item]:
        """A page of a conversation's items (newest first by default, as OpenAI's)."""
        limit, order = check_limit(limit), check_order(order)
        await self._owned(conversations, "conversation", user, conversation_id)
        table = conversation_items
        cursor = None
        if after is not None:
            found = select(table.c.position).where(table.c.id == after, table.c.conversation_id == conversation_id)
            cursor = (await self.conn.execute(found)).scalar() if _usable(after) else None
            if cursor is None:
                raise bad_request(f"'after' names no item of this conversation: '{str(after)[:_ID_MAX]}'", "after")
        query = select(table).where(table.c.conversation_id == conversation_id)
        rows, more = await self._page(query, table.c.position, cursor, order, limit)
        return Page([_item(row) for row in rows], more)

    async def all_messages(self, user: str, conversation_id: str) -> list[dict[str, Any]]:
        """The whole conversation as chat messages, oldest first, for a prompt: image references are
        resolved into ``data:`` URLs (a 400 naming the conversation and the digest where an image is gone)."""
        await self._owned(conversations, "conversation", user, conversation_id)
        table = conversation_items
        query = select(table.c.type, table.c.role, table.c.content, table.c.reasoning).where(
            table.c.conversation_id == conversation_id).order_by(table.c.position)
        messages = items_to_messages([tuple(row) for row in (await self.conn.execute(query)).all()])
        return await self.resolve_images(messages, f"the stored conversation '{conversation_id}'", "conversation")

    async def append_items(
        self, user: str, conversation_id: str, items: Iterable[NewItem | Mapping[str, Any]]
    ) -> list[Item]:
        """Add items at the end of a conversation (the conversation row is locked while positions are taken)."""
        new, found = await externalize_items(_new_items(items))
        await self._owned(conversations, "conversation", user, conversation_id, lock=True)
        table = conversation_items
        last = select(func.max(table.c.position)).where(table.c.conversation_id == conversation_id)
        start = (await self.conn.execute(last)).scalar()
        return await self._insert_items(conversation_id, new, 0 if start is None else start + 1, found)

    async def _insert_items(
        self, conversation_id: str, new: list[NewItem], start: int, found: Mapping[str, StoredImage] | None = None
    ) -> list[Item]:
        """Write ``new`` from ``start``; ``found``: the images of ``new`` already externalized (None: not yet)."""
        if found is None:
            new, found = await externalize_items(new)
        await self.save_images(found)
        now = int(time.time())
        prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        stored = [Item(new_id(prefixes[item.type]), item.type, item.role, item.content, item.reasoning, now)
                  for item in new]
        if stored:
            rows = [{"conversation_id": conversation_id, "position": start + i, "id": item.id, "type": item.type,
                     "role": item.role, "content": item.content, "reasoning": item.reasoning, "created": now}
                    for i, item in enumerate(stored)]
            await self.conn.execute(insert(conversation_items), rows)
        return stored

    async def delete_conversation(self, user: str, conversation_id: str) -> None:
        """Delete a conversation and its items."""
        await self._owned(conversations, "conversation", user, conversation_id, lock=True)
        await self.conn.execute(delete(conversations).where(conversations.c.id == conversation_id))

    # ----------------------------------------------------------------- images

    async def save_images(self, found: Mapping[str, StoredImage]) -> None:
        """Add the images (by sha256 digest) the table lacks; a stored one is never sent again."""
        if not found:
            return
        query = select(images.c.sha256).where(images.c.sha256.in_(list(found)))
        stored = set((await self.conn.execute(query)).scalars())
        now = int(time.time())
        rows = [{"sha256": digest, "media_type": image.media_type, "data": image.data, "created_at": now}
                for digest, image in found.items() if digest not in stored]
        if rows:
            # a concurrent transaction may add the same image first: that row is the same bytes
            dialect = postgresql if self.conn.dialect.name == "postgresql" else sqlite
            await self.conn.execute(dialect.insert(images).on_conflict_do_nothing(index_elements=["sha256"]), rows)

    async def load_images(self, digests: Iterable[str]) -> dict[str, StoredImage]:
        """The stored images among ``digests``."""
        wanted = sorted(set(digests))
        if not wanted:
            return {}
        query = select(images.c.sha256, images.c.media_type, images.c.data).where(images.c.sha256.in_(wanted))
        return {row.sha256: StoredImage(row.media_type, bytes(row.data)) for row in await self.conn.execute(query)}

    async def resolve_images(self, messages: list[dict[str, Any]], owner: str, param: str) -> list[dict[str, Any]]:
        """``messages`` with every image reference replaced by its ``data:`` URL; a 400 naming ``owner``
        (such as "the stored conversation 'conv_…'") and the first missing digest where an image is gone."""
        digests = image_refs.digests_in(messages)
        if not digests:
            return messages
        found = await self.load_images(digests)
        missing = sorted(digests - found.keys())
        if missing:
            raise bad_request(f"{owner} refers to an image that is no longer stored: "
                              f"{image_refs.reference(missing[0])}", param, code="image_not_found")

        def resolve() -> list[dict[str, Any]]:
            urls = {digest: image.data_url() for digest, image in found.items()}
            return [image_refs.map_message(message, lambda url: urls.get(image_refs.referenced_digest(url) or "", url))
                    for message in messages]

        if sum(len(image.data) for image in found.values()) > THREAD_THRESHOLD:
            return await asyncio.to_thread(resolve)
        return resolve()


def _completion(row: Row) -> StoredCompletion:
    return StoredCompletion(row.id, row.user_id, row.created, row.model, row.request, row.response, row.meta, row.tags)


def _item(row: Row) -> Item:
    return Item(row.id, row.type, row.role, row.content, row.reasoning, row.created)


async def externalize_messages(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, StoredImage]]:
    """Chat messages with their data URLs as references, and the images by digest (large payloads
    are decoded and hashed in a worker thread)."""
    def run() -> tuple[list[dict[str, Any]], dict[str, StoredImage]]:
        collect = Externalizer()
        return [image_refs.map_message(message, collect) for message in messages], collect.images

    if image_refs.inline_size(list(messages), image_refs.map_message) > THREAD_THRESHOLD:
        return await asyncio.to_thread(run)
    return run()


async def externalize_items(new: list[NewItem]) -> tuple[list[NewItem], dict[str, StoredImage]]:
    """Items with their data URLs as references, and the images by digest (see :func:`externalize_messages`)."""
    def run() -> tuple[list[NewItem], dict[str, StoredImage]]:
        collect = Externalizer()
        out = [dataclasses.replace(item, content=image_refs.map_content(item.content, collect)) for item in new]
        return out, collect.images

    if image_refs.inline_size([item.content for item in new]) > THREAD_THRESHOLD:
        return await asyncio.to_thread(run)
    return run()


def _new_items(items: Iterable[NewItem | Mapping[str, Any]]) -> list[NewItem]:
    return [item if isinstance(item, NewItem) else parse_item(item, f"items[{i}]") for i, item in enumerate(items)]


def _message_position(completion_id: str, after: str) -> int:
    prefix, _, number = str(after).rpartition("-")
    if prefix != completion_id or not number.isdigit():
        raise bad_request(f"'after' names no message of this completion: '{str(after)[:_ID_MAX]}'", "after")
    return int(number)


# --------------------------------------------------------------------------- the store


def resolve_url(target: str | Path) -> URL:
    """A SQLite path, ``sqlite:///…``, or ``postgresql://…`` as an async driver URL."""
    text = str(target).strip()
    if not text:
        raise StoreError("no store location given")
    if "://" not in text:
        return URL.create("sqlite+aiosqlite", database=str(Path(text).expanduser().resolve()))
    try:
        url = make_url(text)
    except ArgumentError:
        raise StoreError(f"not a database URL: {text!r}") from None
    backend = url.get_backend_name()
    if backend == "sqlite":
        return url.set(drivername="sqlite+aiosqlite")
    if backend in ("postgresql", "postgres"):
        return url.set(drivername="postgresql+asyncpg")
    raise StoreError(f"unsupported store URL {url.drivername!r}: give a SQLite file path or a postgresql:// URL")


def default_store_path() -> Path:
    """Where the SQLite store lives when no location is configured: ``$XDG_DATA_HOME/trellis/store.sqlite3``
    (``~/.local/share/trellis/store.sqlite3`` without XDG_DATA_HOME)."""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "trellis" / "store.sqlite3"


def _dumps(value: Any) -> str:
    # msgspec writes NaN/inf (logprobs can be -inf) as null, which PostgreSQL's json type accepts.
    return msgspec.json.encode(value).decode()


def _sqlite_hooks(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver's own BEGIN handling is off; on_begin emits it
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def on_begin(conn: Connection) -> None:
        # A write transaction takes the write lock up front: a deferred one that reads first and then
        # writes fails at once (SQLITE_BUSY, no busy wait) when another writer committed in between.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("trellis_write") else "BEGIN")


def _is_sqlite_memory(url: URL | None) -> bool:
    return url is not None and url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def _create_engine(url: URL) -> AsyncEngine:
    options: dict[str, Any] = {"json_serializer": _dumps, "json_deserializer": msgspec.json.decode}
    if url.get_backend_name() != "sqlite":
        return create_async_engine(url, pool_pre_ping=True, **options)
    Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, connect_args={"timeout": 30.0}, **options)
    _sqlite_hooks(engine)
    return engine


async def _migrate(conn: AsyncConnection) -> None:
    version = schema.schema_version
    current = (await conn.execute(select(func.max(version.c.version)))).scalar()
    if current is not None and current > SCHEMA_VERSION:
        raise StoreError(f"the store's schema is version {current}, newer than this server's {SCHEMA_VERSION}")
    first = SCHEMA_VERSION if current is None else current + 1  # a new database is created at the latest version
    for step in range(first, SCHEMA_VERSION + 1):
        if step in MIGRATIONS:
            await conn.run_sync(MIGRATIONS[step])
        await conn.execute(insert(version).values(version=step, applied_at=int(time.time())))


class Store:
    """Stored chat completions and conversations. Open with ``await Store.open(url)``; ``await close()``."""

    def __init__(self, engine: AsyncEngine, scratch_dir: Path | None = None) -> None:
        self.engine = engine
        self._writer = engine.execution_options(trellis_write=True)
        self._scratch_dir = scratch_dir

    @classmethod
    async def open(cls, url: str | Path) -> Store:
        """Connect, create missing tables and record the schema version.

        ``url``: a SQLite file path (WAL journal, foreign keys on), ``sqlite:///path``,
        ``postgresql://user:pass@host:port/db`` (also ``postgresql+asyncpg://``), or ``:memory:`` for a
        throwaway SQLite file deleted by :meth:`close` (a real in-memory database is one connection,
        which concurrent transactions cannot share).
        """
        scratch = None
        if str(url).strip() == ":memory:" or _is_sqlite_memory(make_url(str(url)) if "://" in str(url) else None):
            scratch = Path(tempfile.mkdtemp(prefix="trellis-store-"))
            url = scratch / "store.sqlite3"
        store = cls(_create_engine(resolve_url(url)), scratch)
        try:
            async with store._writer.begin() as conn:
                await conn.run_sync(schema.metadata.create_all)
                await _migrate(conn)
        except BaseException:
            await store.close()
            raise
        return store

    async def close(self) -> None:
        """Close every pooled connection (and delete a ``:memory:`` store's file)."""
        await self.engine.dispose()
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.engine.dialect.name

    def describe(self) -> str:
        """A log line naming the database (the password hidden)."""
        return f"store: {self.backend} at {self.engine.url.render_as_string(hide_password=True)}"

    @asynccontextmanager
    async def transaction(self, *, write: bool = True) -> AsyncIterator[Tx]:
        """One transaction: committed when the block ends, rolled back when it raises.

        A database that cannot serve (see :func:`database_unavailable`) raises ``APIError`` 503
        ``store_unavailable``; the transaction is then not committed, unless the connection was lost
        while the commit itself was under way (its outcome is unknown, but all or nothing).
        """
        try:
            async with (self._writer if write else self.engine).begin() as conn:
                yield Tx(conn)
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            # The first line only: the rest repeats the statement and its parameters (users' text).
            reason = (str(exc).splitlines() or [""])[0] or type(exc).__name__
            log.warning("store unavailable (%s): %s", self.backend, reason)
            raise store_unavailable() from exc

    async def save_completion(
        self,
        user: str,
        completion_id: str,
        model: str,
        request: Mapping[str, Any],
        response: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        tags: Sequence[str] | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
    ) -> StoredCompletion:
        """See :meth:`Tx.save_completion`."""
        async with self.transaction() as tx:
            return await tx.save_completion(user, completion_id, model, request, response, metadata, tags, messages)

    async def list_completions(
        self,
        user: str,
        *,
        model: str | None = None,
        metadata: Mapping[str, str] | None = None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
    ) -> Page[StoredCompletion]:
        """See :meth:`Tx.list_completions`."""
        async with self.transaction(write=False) as tx:
            return await tx.list_completions(
                user, model=model, metadata=metadata, after=after, limit=limit, order=order)

    async def get_completion(self, user: str, completion_id: str) -> StoredCompletion:
        """See :meth:`Tx.get_completion`."""
        async with self.transaction(write=False) as tx:
            return await tx.get_completion(user, completion_id)

    async def get_messages(
        self, user: str, completion_id: str, *, after: str | None = None, limit: int = 20, order: Order = "asc"
    ) -> Page[StoredMessage]:
        """See :meth:`Tx.get_messages`."""
        async with self.transaction(write=False) as tx:
            return await tx.get_messages(user, completion_id, after=after, limit=limit, order=order)

    async def update_metadata(
        self, user: str, completion_id: str, metadata: Mapping[str, str] | None
    ) -> StoredCompletion:
        """See :meth:`Tx.update_metadata`."""
        async with self.transaction() as tx:
            return await tx.update_metadata(user, completion_id, metadata)

    async def delete_completion(self, user: str, completion_id: str) -> None:
        """See :meth:`Tx.delete_completion`."""
        async with self.transaction() as tx:
            await tx.delete_completion(user, completion_id)

    async def create_conversation(
        self, user: str, metadata: Mapping[str, str] | None = None, items: Iterable[NewItem | Mapping[str, Any]] = ()
    ) -> Conversation:
        """See :meth:`Tx.create_conversation`."""
        async with self.transaction() as tx:
            return await tx.create_conversation(user, metadata, items)

    async def get_conversation(self, user: str, conversation_id: str) -> Conversation:
        """See :meth:`Tx.get_conversation`."""
        async with self.transaction(write=False) as tx:
            return await tx.get_conversation(user, conversation_id)

    async def list_items(
        self, user: str, conversation_id: str, *, after: str | None = None, limit: int = 20, order: Order = "desc"
    ) -> Page[Item]:
        """See :meth:`Tx.list_items`."""
        async with self.transaction(write=False) as tx:
            return await tx.list_items(user, conversation_id, after=after, limit=limit, order=order)

    async def append_items(
        self, user: str, conversation_id: str, items: Iterable[NewItem | Mapping[str, Any]]
    ) -> list[Item]:
        """See :meth:`Tx.append_items`."""
        async with self.transaction() as tx:
            return await tx.append_items(user, conversation_id, items)

    async def delete_conversation(self, user: str, conversation_id: str) -> None:
        """See :meth:`Tx.delete_conversation`."""
        async with self.transaction() as tx:
            await tx.delete_conversation(user, conversation_id)
