"""What the chat flow calls: a conversation's history as messages, and recording a finished completion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from server.errors import bad_request
from server.store.items import message_to_items, validate_metadata, validate_tags
from server.store.store import Store, externalize_messages

_REASONING_KEYS = ("reasoning_content", "reasoning")


def conversation_id_of(conversation: str | Mapping[str, Any] | None) -> str | None:
    """The id in a request's ``conversation`` field (``"conv_…"`` or ``{"id": "conv_…"}``)."""
    if conversation is None:
        return None
    if isinstance(conversation, Mapping):
        conversation = conversation.get("id")
    if not isinstance(conversation, str) or not conversation:
        raise bad_request("conversation must be a conversation id or an object with an 'id'", "conversation")
    return conversation


async def conversation_messages(store: Store, user: str, conversation: str | Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation's items as chat messages, oldest first, to put before the request's messages.

    Stored image references come back as ``data:`` URLs. Raises ``APIError`` 404 for an unknown
    conversation, 403 for another user's, and 400 where an image it refers to is no longer stored.
    """
    conversation_id = conversation_id_of(conversation)
    async with store.transaction(write=False) as tx:
        return await tx.all_messages(user, conversation_id)


def without_reasoning(response: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a chat completion whose choices' messages carry no reasoning text."""
    choices = []
    for choice in response.get("choices") or []:
        message = {k: v for k, v in (choice.get("message") or {}).items() if k not in _REASONING_KEYS}
        choices.append({**choice, "message": message})
    return {**response, "choices": choices}


async def record(
    store: Store,
    user: str,
    request_wire: Mapping[str, Any],
    response: Mapping[str, Any],
    *,
    store_completion: bool,
    conversation_id: str | None,
    store_reasoning: bool,
) -> None:
    """Write a finished chat completion in ONE transaction, before its response is sent.

    With ``store_completion`` the completion is stored (request without ``messages``, response, the
    request's ``metadata`` and ``tags``, and its input messages). With ``conversation_id`` the request's
    last message and the first choice's message are appended to that conversation (404/403 as
    ``APIError``, and then nothing at all is written). ``store_reasoning=False`` drops reasoning text.
    Image data URLs are stored as references to one ``images`` row each (:mod:`server.store.images`),
    decoded and hashed before the transaction begins.
    """
    if not store_completion and not conversation_id:
        return
    if not store_reasoning:
        response = without_reasoning(response)
    messages, found = await externalize_messages(list(request_wire.get("messages") or []))
    async with store.transaction() as tx:
        await tx.save_images(found)
        if store_completion:
            model = str(response.get("model") or request_wire.get("model") or "")
            await tx.save_completion(
                user, str(response["id"]), model, request_wire, response,
                validate_metadata(request_wire.get("metadata")), validate_tags(request_wire.get("tags")), messages,
            )
        if conversation_id:
            turn = message_to_items(messages[-1], keep_reasoning=store_reasoning) if messages else []
            choices = response.get("choices") or []
            if choices and choices[0].get("message"):
                turn += message_to_items(choices[0]["message"], keep_reasoning=store_reasoning)
            await tx.append_items(user, conversation_id, turn)
