"""Tool definitions and request helpers shared by the tool tests."""

from __future__ import annotations

from typing import Any

from server.protocol import ChatCompletionRequest, ChatMessage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def request(**fields: Any) -> ChatCompletionRequest:
    """A chat request with one user message plus ``fields``."""
    fields.setdefault("messages", [ChatMessage(role="user", content="hi")])
    return ChatCompletionRequest(**fields)
