"""Tables of the store (SQLAlchemy Core) and the schema version they make up.

Rows that list in order carry an explicit order key: ``seq`` (autoincrement) for completions and
conversations, ``position`` within a completion or conversation for messages and items. Children
reference their parent's public id with ``ON DELETE CASCADE``, so deleting a parent is one statement.
Images of stored messages and items live once each in ``images``, keyed by the sha256 of their bytes
(see :mod:`server.store.images`).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

SCHEMA_VERSION = 2
"""Bump with every schema change and add a step to ``server.store.store.MIGRATIONS``.

1: completions, their messages and metadata; conversations and their items.
2: ``images`` (stored image parts by content hash; messages and items hold references to them).
"""

# SQLite only autoincrements an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
_Seq = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

schema_version = Table(
    "trellis_schema_version",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("applied_at", BigInteger, nullable=False),
)

chat_completions = Table(
    "chat_completions",
    metadata,
    Column("seq", _Seq, primary_key=True, autoincrement=True),
    Column("id", String(100), nullable=False, unique=True),
    Column("user_id", Text, nullable=False),
    Column("created", BigInteger, nullable=False),
    Column("model", Text, nullable=False),
    Column("request", JSON, nullable=False),
    Column("response", JSON, nullable=False),
    Column("meta", JSON, nullable=False),
    Column("tags", JSON, nullable=False),
    Index("ix_chat_completions_user_seq", "user_id", "seq"),
)

# Metadata again as key/value rows: filters are plain indexed equality joins on every backend, with
# no JSON-path quoting of client-chosen keys.
completion_metadata = Table(
    "chat_completion_metadata",
    metadata,
    Column("completion_id", String(100), ForeignKey("chat_completions.id", ondelete="CASCADE"), primary_key=True),
    Column("key", Text, primary_key=True),
    Column("value", Text, nullable=False),
    Index("ix_chat_completion_metadata_key_value", "key", "value"),
)

completion_messages = Table(
    "chat_completion_messages",
    metadata,
    Column("completion_id", String(100), ForeignKey("chat_completions.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True, autoincrement=False),
    Column("message", JSON, nullable=False),
)

conversations = Table(
    "conversations",
    metadata,
    Column("seq", _Seq, primary_key=True, autoincrement=True),
    Column("id", String(100), nullable=False, unique=True),
    Column("user_id", Text, nullable=False),
    Column("created", BigInteger, nullable=False),
    Column("meta", JSON, nullable=False),
    Index("ix_conversations_user_seq", "user_id", "seq"),
)

conversation_items = Table(
    "conversation_items",
    metadata,
    Column("conversation_id", String(100), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True),
    Column("position", Integer, primary_key=True, autoincrement=False),
    Column("id", String(100), nullable=False, unique=True),
    Column("type", String(40), nullable=False),
    Column("role", String(20)),
    Column("content", JSON, nullable=False),
    Column("reasoning", Text),
    Column("created", BigInteger, nullable=False),
)

images = Table(
    "images",
    metadata,
    Column("sha256", String(64), primary_key=True),  # lowercase hex of the image bytes' sha256
    Column("media_type", String(127), nullable=False),
    Column("data", LargeBinary, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)
