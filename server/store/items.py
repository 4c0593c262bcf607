"""Conversation items: validation of the Conversations API's input items, and conversion between items
and chat messages (both directions).

Items follow the Responses API: ``message`` (role + content parts), ``function_call`` and
``function_call_output``. A chat assistant message with tool calls becomes a message item followed by
one ``function_call`` item per call, and turns back into one assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import bad_request

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
ITEM_TYPES = frozenset({"message", "function_call", "function_call_output"})
MAX_METADATA_PAIRS = 16
MAX_ITEMS_PER_REQUEST = 20
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True, slots=True)
class NewItem:
    """An item ready to be written: ``content`` is a part list (messages) or a dict (calls, outputs)."""

    type: str
    role: str | None
    content: Any
    reasoning: str | None = None


# --------------------------------------------------------------------------- validation


def _clean_text(value: str) -> str:
    # PostgreSQL TEXT cannot hold NUL; JSON columns can (as \u0000), so only plain columns need this.
    return value.replace("\x00", "\ufffd")


def validate_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 string pairs, keys <= 64 and values <= 512 characters."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("metadata must be an object of string keys and string values", param)
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata can have at most {MAX_METADATA_PAIRS} pairs", param)
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= 64 or "\x00" in key:
            raise bad_request("metadata keys must be non-empty strings of at most 64 characters", param)
        if not isinstance(item, str) or len(item) > 512 or "\x00" in item:
            raise bad_request(f"metadata[{key!r}] must be a string of at most 512 characters", param)
    return dict(value)


def validate_tags(value: Any, param: str = "tags") -> list[str]:
    """A list of strings (None is no tags)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(tag, str) and "\x00" not in tag for tag in value):
        raise bad_request("tags must be a list of strings", param)
    return list(value)


def _text_part(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _parts(role: str, content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_text_part(role, content)]
    if not isinstance(content, list) or not content:
        raise bad_request("content must be a string or a non-empty list of content parts", param)
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request("every content part must be an object with a 'type'", param)
        if part["type"] in _TEXT_PARTS and not isinstance(part.get("text"), str):
            raise bad_request(f"a '{part['type']}' part needs a string 'text'", param)
    return [dict(part) for part in content]


def _require_str(item: dict[str, Any], field: str, param: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise bad_request(f"'{field}' must be a string", f"{param}.{field}")
    return value


def parse_item(item: Any, param: str = "items[0]") -> NewItem:
    """One Conversations API input item (``{"role", "content"}`` or a typed item) as a :class:`NewItem`."""
    if not isinstance(item, dict):
        raise bad_request("an item must be an object", param)
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise bad_request(f"item type {kind!r} is not supported (use {', '.join(sorted(ITEM_TYPES))})", param)
    if kind == "function_call":
        fields = {name: _require_str(item, name, param) for name in ("call_id", "name", "arguments")}
        return NewItem("function_call", None, fields)
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise bad_request("'output' must be a string or a list of content parts", f"{param}.output")
        call_id = _require_str(item, "call_id", param)
        return NewItem("function_call_output", None, {"call_id": call_id, "output": output})
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"role must be one of {', '.join(sorted(MESSAGE_ROLES))}", f"{param}.role")
    return NewItem("message", role, _parts(role, item.get("content"), f"{param}.content"))


def parse_items(items: Any, param: str = "items", *, limit: int = MAX_ITEMS_PER_REQUEST) -> list[NewItem]:
    """A list of input items (at most ``limit``; OpenAI takes 20 per request)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise bad_request("items must be a list", param)
    if len(items) > limit:
        raise bad_request(f"at most {limit} items can be added at a time", param)
    return [parse_item(item, f"{param}[{index}]") for index, item in enumerate(items)]


# --------------------------------------------------------------------------- chat message -> items


def _chat_part(role: str, part: Any) -> dict[str, Any]:
    if not isinstance(part, dict):
        return _text_part(role, str(part))
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return _text_part(role, part["text"])
    if part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        image = part["image_url"]
        return {"type": "input_image", "image_url": image.get("url"), "detail": image.get("detail", "auto")}
    return dict(part)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def message_to_items(message: dict[str, Any], *, keep_reasoning: bool = True) -> list[NewItem]:
    """A chat message (request or response wire dict) as the items that represent it."""
    role = message.get("role")
    if role in ("tool", "function"):
        call_id = message.get("tool_call_id") or message.get("name") or ""
        return [NewItem("function_call_output", None, {"call_id": call_id, "output": _text_of(message.get("content"))})]
    if role not in MESSAGE_ROLES:
        raise bad_request(f"a message with role {role!r} cannot be stored in a conversation", "messages")
    content = message.get("content")
    parts = [_chat_part(role, part) for part in content] if isinstance(content, list) else (
        [_text_part(role, content)] if isinstance(content, str) else [])
    reasoning = (message.get("reasoning_content") or message.get("reasoning")) if keep_reasoning else None
    calls = message.get("tool_calls") or []
    items = []
    if parts or not calls:
        items.append(NewItem("message", role, parts, _clean_text(reasoning) if isinstance(reasoning, str) else None))
    for call in calls:
        function = call.get("function") or {}
        items.append(NewItem("function_call", None, {
            "call_id": call.get("id", ""), "name": function.get("name", ""), "arguments": function.get("arguments", ""),
        }))
    return items


# --------------------------------------------------------------------------- items -> chat messages


def _message_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    parts = [part for part in parts if part.get("type") != "reasoning_text"]
    if all(part.get("type") in _TEXT_PARTS or part.get("type") == "refusal" for part in parts):
        return "".join(part.get("text") or part.get("refusal") or "" for part in parts)
    converted = []
    for part in parts:
        if part.get("type") in _TEXT_PARTS:
            converted.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "input_image":
            image = {"url": part.get("image_url"), "detail": part.get("detail", "auto")}
            converted.append({"type": "image_url", "image_url": image})
        else:
            converted.append(part)
    return converted


def items_to_messages(items: list[tuple[str, str | None, Any, str | None]]) -> list[dict[str, Any]]:
    """``(type, role, content, reasoning)`` rows, in order, as chat messages for a prompt."""
    messages: list[dict[str, Any]] = []
    for kind, role, content, reasoning in items:
        if kind == "message":
            message: dict[str, Any] = {"role": role, "content": _message_content(content)}
            if reasoning is not None and role == "assistant":
                message["reasoning_content"] = reasoning
            messages.append(message)
        elif kind == "function_call":
            call = {"id": content["call_id"], "type": "function",
                    "function": {"name": content["name"], "arguments": content["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = content["output"]
            messages.append({"role": "tool", "tool_call_id": content["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output)})
    return messages
