"""render_messages with the default model's template (no tool support: default format) and with a
small tool-aware template (OpenAI-shaped messages + tools=)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.errors import APIError
from server.protocol import ChatMessage
from server.tools import format_call, render_messages, template_supports_tools

from .toolcases import TIME, WEATHER, plan_for

TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}>{% endfor %}"
    "{% if m.role == 'tool' %}({{ m.tool_call_id }} {{ m.name }}){% endif %}\n{% endfor %}"
)


def _history() -> list[ChatMessage]:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
        },
    ]
    return [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "Weather"}, {"type": "text", "text": "and time?"}]
        ),
        ChatMessage(role="assistant", content=None, tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny, 21C"),
        ChatMessage(role="tool", tool_call_id="call_2", content="14:05"),
        ChatMessage(role="assistant", content="Sunny and 14:05."),
        ChatMessage(role="user", content="Thanks"),
    ]


def test_default_template_has_no_tool_support(tokenizer: Any) -> None:
    assert not template_supports_tools(tokenizer, None)
    assert template_supports_tools(tokenizer, TOOL_TEMPLATE)
    assert not template_supports_tools(tokenizer, "{{ messages }}")


def test_default_format_renders_through_the_real_template(tokenizer: Any) -> None:
    plan = plan_for([WEATHER, TIME])
    messages, tools = render_messages(_history(), plan, template_supports_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER["function"]) in system and '"get_time"' in system
    assert messages[1]["content"] == "Weather\nand time?"
    assert messages[2]["content"] == (
        format_call("get_weather", '{"city": "Paris"}') + format_call("get_time", '{"zone": "CET"}')
    )
    assert (
        messages[3]["content"]
        == "<tool_response>\nsunny, 21C\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    )
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in prompt
    assert "<|im_start|>assistant\n" + format_call("get_weather", '{"city": "Paris"}') in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_default_format_adds_a_system_message_when_missing(tokenizer: Any) -> None:
    messages, _ = render_messages([ChatMessage(role="user", content="hi")], plan_for([WEATHER]), False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in prompt and "SmolLM" not in prompt


@pytest.mark.parametrize(
    ("choice", "phrase"),
    [
        ("required", "must call at least one"),
        ({"type": "function", "function": {"name": "get_time"}}, "must call the function get_time"),
    ],
)
def test_system_prompt_states_the_policy(choice: Any, phrase: str) -> None:
    messages, _ = render_messages(
        [ChatMessage(role="user", content="hi")], plan_for([WEATHER, TIME], tool_choice=choice), False
    )
    assert phrase in messages[0]["content"]


def test_none_mode_and_plain_requests_show_no_tools() -> None:
    plain = [ChatMessage(role="system", content="S"), ChatMessage(role="user", content="hi")]
    for plan in (None, plan_for([WEATHER], tool_choice="none")):
        messages, tools = render_messages(plain, plan, False)
        assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
        assert tools is None


def test_history_without_tools_still_renders() -> None:
    messages, _ = render_messages(_history(), None, False)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["content"].startswith("<tool_call>")


def test_tool_aware_template_gets_openai_shape(tokenizer: Any) -> None:
    messages, tools = render_messages(_history(), plan_for([WEATHER, TIME]), template_supports_tools=True)
    assert tools == [WEATHER, TIME]
    assistant = messages[2]
    assert assistant["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert messages[3] == {
        "role": "tool",
        "content": "sunny, 21C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    prompt = tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE, tokenize=False)
    assert prompt.startswith("TOOLS:get_weather;get_time;[system]Be brief.")
    assert "<call call_1 get_weather Paris>" in prompt and "(call_2 get_time)" in prompt


def test_legacy_function_messages() -> None:
    history = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", function_call={"name": "get_weather", "arguments": '{"city": "Rome"}'}),
        ChatMessage(role="function", name="get_weather", content="rain"),
    ]
    plan = plan_for(None, functions=[WEATHER["function"]])
    messages, _ = render_messages(history, plan, False)
    assert messages[2]["content"] == format_call("get_weather", '{"city": "Rome"}')
    assert messages[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}
    shaped, _ = render_messages(history, plan, True)
    assert shaped[1]["tool_calls"][0]["id"] == shaped[2]["tool_call_id"]
    assert shaped[2]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]),
            "messages[1].content",
        ),
        (ChatMessage(role="user", content=[{"text": "no type"}]), "messages[1].content"),
        (ChatMessage(role="user"), "messages[1].content"),
        (ChatMessage(role="tool", content="x"), "messages[1].tool_call_id"),
        (ChatMessage(role="function", content="x"), "messages[1].name"),
        (ChatMessage(role="assistant"), "messages[1].content"),
        (
            ChatMessage(role="assistant", tool_calls=[{"type": "function", "function": {"name": "a"}}]),
            "messages[1].tool_calls[0].id",
        ),
        (
            ChatMessage(role="assistant", tool_calls=[{"id": "c", "function": {"arguments": "{}"}}]),
            "messages[1].tool_calls[0].function.name",
        ),
        (
            ChatMessage(
                role="assistant", tool_calls=[{"id": "c", "function": {"name": "a", "arguments": {}}}]
            ),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_messages(message: ChatMessage, param: str) -> None:
    with pytest.raises(APIError) as info:
        render_messages([ChatMessage(role="user", content="hi"), message], None, False)
    assert info.value.status == 400 and info.value.param == param
