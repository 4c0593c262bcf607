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


def plan_for(tools: list[dict[str, Any]] | None, **fields: Any) -> Any:
    """The validated plan for a request with ``tools`` and ``fields``."""
    from server.tools import plan_tools

    if tools is not None:
        fields["tools"] = tools
    plan = plan_tools(request(**fields))
    assert plan is not None
    return plan


def matches(compiler: Any, tokenizer: Any, tag: dict[str, Any], text: str, *, tokens: bool = False) -> bool:
    """Whether the compiled structural tag accepts exactly ``text`` followed by end of sequence."""
    import json

    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    if tokens:
        accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    else:
        accepted = matcher.accept_string(text)
    return accepted and matcher.accept_token(tokenizer.eos_token_id)
