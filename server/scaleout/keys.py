"""The cache-affinity key of a request: a hash of its leading prompt text and of its constraint.

Two requests with the same key would find the same prompt prefix and the same compiled constraint in
a replica's caches, so the router sends them to the same replica. The key is computed at the entry
point from the raw body, before any validation (a body that does not parse has no key and goes to
the least loaded replica, which answers the 400).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

PREFIX_CHARS = 1024
"""Leading prompt characters that make the key (about the first few hundred tokens)."""

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v0/chat/completions", "/v0/completions"})

_CONSTRAINT_FIELDS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "structured_outputs", "regex", "ebnf", "json_schema",
    "tools", "tool_choice", "functions", "function_call",
)


def affinity_key(method: str, path: str, body: bytes) -> str | None:
    """The routing key of a generation request, or None (any replica will do)."""
    if method != "POST" or path not in GENERATION_PATHS or not body:
        return None
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(request, dict):
        return None
    prefix = leading_prompt_text(request)
    constraint = _canonical({name: request[name] for name in _CONSTRAINT_FIELDS if request.get(name) is not None})
    if not prefix and constraint == b"{}":
        return None
    digest = hashlib.blake2b(digest_size=12)
    digest.update(prefix.encode("utf-8", "replace"))
    digest.update(b"\0")
    digest.update(constraint)
    return digest.hexdigest()


def leading_prompt_text(request: dict[str, Any]) -> str:
    """The first ``PREFIX_CHARS`` of the prompt (``prompt_cache_key`` when the client names one)."""
    cache_key = request.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return "key:" + cache_key
    if "messages" in request:
        text = _messages_text(request.get("messages"))
    else:
        text = _prompt_text(request.get("prompt"))
    return text[:PREFIX_CHARS]


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        piece = f"<{message.get('role')}>{_content_text(message.get('content'))}"
        parts.append(piece)
        size += len(piece)
        if size >= PREFIX_CHARS:
            break
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _prompt_text(prompt: Any) -> str:
    """A string prompt, the first of a batch, or token ids written out."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(str(token) for token in prompt[:PREFIX_CHARS // 4])
        if isinstance(first, list):
            return " ".join(str(token) for token in first[:PREFIX_CHARS // 4])
    return ""


def _canonical(value: Any) -> bytes:
    """Key-order-independent JSON, so equal schemas written differently hash alike."""
    return msgspec.json.encode(value, order="sorted")
