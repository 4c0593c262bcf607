"""End to end: function calling through the official `openai` SDK against the default model.

The generating requests are independent, so one module fixture sends them all at once (the engine
batches them) and the tests check the answers; bad tool definitions are refused before any
generation.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from jsonschema.validators import validator_for

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
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
        "description": "Get the current local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PARIS = "What's the weather like in Paris?"
TWO_THINGS = "What's the weather in Paris, and what time is it in Tokyo?"
RESULT = '{"temperature": 21, "unit": "celsius", "condition": "sunny"}'
FOLLOW_UP = [
    {"role": "user", "content": PARIS},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_w1", "content": RESULT},
]


def _user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


REQUESTS: dict[str, dict[str, Any]] = {
    "required": dict(messages=_user(PARIS), tools=TOOLS, tool_choice="required"),
    "required_stream": dict(messages=_user(PARIS), tools=TOOLS, tool_choice="required", stream=True),
    "named": dict(messages=_user(PARIS), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
    "auto": dict(messages=_user(PARIS), tools=TOOLS, tool_choice="auto", max_tokens=40),
    "none": dict(messages=_user(PARIS), tools=TOOLS, tool_choice="none", max_tokens=30),
    "parallel": dict(messages=_user(TWO_THINGS), tools=TOOLS, tool_choice="required", parallel_tool_calls=True),
    "single": dict(messages=_user(TWO_THINGS), tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
    "follow_up": dict(messages=FOLLOW_UP, tools=TOOLS, max_tokens=40),
    "legacy": dict(
        messages=_user(PARIS), functions=[WEATHER["function"]], function_call={"name": "get_weather"}
    ),
}


@pytest.fixture(scope="module")
def replies(real_server) -> dict[str, Any]:
    """Every generating request of this module, sent concurrently; streams collected as chunk lists."""
    client = real_server.client(timeout=300)

    def send(fields: dict[str, Any]) -> Any:
        fields = {"model": MODEL, "temperature": 0, "seed": 7, "max_tokens": 80, **fields}
        reply = client.chat.completions.create(**fields)
        return list(reply) if fields.get("stream") else reply

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = {name: pool.submit(send, fields) for name, fields in REQUESTS.items()}
        return {name: future.result() for name, future in futures.items()}


def check_call(call: Any, allowed: set[str] | None = None) -> dict[str, Any]:
    """A well-formed tool call to a known tool whose arguments validate; returns the arguments."""
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.function.name in (allowed or SCHEMAS)
    assert isinstance(call.function.arguments, str)
    arguments = json.loads(call.function.arguments)
    schema = SCHEMAS[call.function.name]
    validator_for(schema)(schema).validate(arguments)
    return arguments


def test_required_gives_valid_calls(replies) -> None:
    choice = replies["required"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert "paris" in json.loads(choice.message.tool_calls[0].function.arguments)["city"].lower()
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def check_calls_if_any(choice) -> bool:
    """For answers that may be text or calls: every call valid with finish_reason "tool_calls", or
    a text finish. Returns whether calls were made."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            check_call(call)
        return True
    assert choice.finish_reason in ("stop", "length")
    return False


def test_named_choice_calls_that_tool(replies) -> None:
    choice = replies["named"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, {"get_time"})


def test_auto_gives_text_or_a_valid_call(replies) -> None:
    choice = replies["auto"].choices[0]
    if not check_calls_if_any(choice):
        assert choice.message.content and "<tool_call>" not in choice.message.content


def test_none_gives_no_calls(replies) -> None:
    choice = replies["none"].choices[0]
    assert not choice.message.tool_calls
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_parallel_calls_allowed(replies) -> None:
    choice = replies["parallel"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        check_call(call)


def test_parallel_false_gives_exactly_one_call(replies) -> None:
    choice = replies["single"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_streamed_calls_equal_non_streamed(replies) -> None:
    chunks = replies["required_stream"]
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:  # the first delta of a call names it
                assert piece.id and piece.id.startswith("call_")
                assert piece.type == "function"
                assert piece.function.name in SCHEMAS
                calls[piece.index] = {"name": piece.function.name, "arguments": piece.function.arguments or ""}
            else:  # then argument fragments only
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert content == ""
    assert sorted(calls) == list(range(len(calls)))
    streamed = [calls[i] for i in sorted(calls)]
    full = [{"name": c.function.name, "arguments": c.function.arguments} for c in replies["required"].choices[0].message.tool_calls]
    assert streamed == full


def test_follow_up_turn_with_tool_result(replies) -> None:
    choice = replies["follow_up"].choices[0]
    if not check_calls_if_any(choice):
        assert "21" in choice.message.content or "sunny" in choice.message.content.lower()


def test_legacy_functions_answer_with_function_call(replies) -> None:
    choice = replies["legacy"].choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None
    assert choice.message.content is None
    call = choice.message.function_call
    assert call is not None and call.name == "get_weather"
    validator_for(SCHEMAS["get_weather"])(SCHEMAS["get_weather"]).validate(json.loads(call.arguments))


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(tools=[_tool("f", {"type": "object", "properties": {"a": {"type": "strin"}}})], tool_choice="required"),
         "tools[0].function.parameters"),
        (dict(tools=[_tool("f", {"type": "array"})]), "tools[0].function.parameters"),
        (dict(tools=[_tool("f"), WEATHER, _tool("f")]), "tools[2].function.name"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[_tool("bad name!")]), "tools[0].function.name"),
        (dict(function_call={"name": "f"}), "function_call"),
        (dict(functions=[WEATHER["function"]], function_call={"name": "nope"}), "function_call"),
    ],
)
def test_bad_tool_definitions_are_400_naming_the_field(real_server, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        real_server.client().chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=5, **fields)
    assert info.value.status_code == 400
    assert info.value.param == param
