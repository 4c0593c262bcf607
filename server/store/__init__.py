"""Persistence for stored chat completions and conversations (SQLAlchemy async; SQLite or PostgreSQL).

``await Store.open(url)`` at start-up, ``await store.close()`` at shutdown; the chat flow calls
:func:`conversation_messages` before generating and :func:`record` after.

Image parts are kept, by reference: a ``data:`` image URL in a stored completion's messages or a
conversation's items is stored as ``trellis-image:sha256:<hex>``, its bytes once in the ``images``
table (http(s) URLs stay as sent). :func:`conversation_messages` resolves references back into
``data:`` URLs for the prompt; the GET endpoints that list stored messages (``content_parts``) and
conversation items return the reference URLs as stored. See :mod:`server.store.images`.
"""

from server.store.flow import conversation_id_of, conversation_messages, record, without_reasoning
from server.store.items import (
    MAX_ITEMS_PER_REQUEST,
    NewItem,
    items_to_messages,
    message_to_items,
    parse_items,
    validate_metadata,
    validate_tags,
)
from server.store.schema import SCHEMA_VERSION
from server.store.store import (
    MAX_LIMIT,
    Conversation,
    Item,
    Page,
    Store,
    StoredCompletion,
    StoredMessage,
    StoreError,
    Tx,
    default_store_path,
    new_id,
    resolve_url,
)

__all__ = [
    "MAX_ITEMS_PER_REQUEST",
    "MAX_LIMIT",
    "SCHEMA_VERSION",
    "Conversation",
    "Item",
    "NewItem",
    "Page",
    "Store",
    "StoreError",
    "StoredCompletion",
    "StoredMessage",
    "Tx",
    "conversation_id_of",
    "conversation_messages",
    "default_store_path",
    "items_to_messages",
    "message_to_items",
    "new_id",
    "parse_items",
    "record",
    "resolve_url",
    "validate_metadata",
    "validate_tags",
    "without_reasoning",
]
