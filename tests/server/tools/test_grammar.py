"""The structural tag compiles with xgrammar for the default tokenizer and accepts exactly the
calls the plan allows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.errors import APIError
from server.tools import format_call, tool_constraint_spec, tool_structural_tag

from .toolcases import NOARGS, TIME, WEATHER, matches, plan_for

PARIS = format_call("get_weather", '{"city": "Paris", "unit": "c"}')
UTC = format_call("get_time", '{"zone": "UTC"}')
PING = format_call("ping", "{}")


def _accepts(compiler: Any, tokenizer: Any, plan: Any, text: str) -> bool:
    return matches(compiler, tokenizer, tool_structural_tag(plan), text)


def test_none_and_no_plan_have_no_constraint() -> None:
    assert tool_structural_tag(None) is None
    assert tool_structural_tag(plan_for([WEATHER], tool_choice="none")) is None
    assert tool_constraint_spec(None) is None


def test_constraint_spec_wraps_the_tag() -> None:
    pytest.importorskip("constraints.spec")
    plan = plan_for([WEATHER], tool_choice="required")
    spec = tool_constraint_spec(plan)
    assert spec is not None and spec.kind == "structural_tag"
    assert spec.source == tool_structural_tag(plan)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (PARIS, True),
        (UTC, True),
        (PING, True),
        (PARIS + UTC, True),
        (PARIS + PARIS + PING, True),
        (PARIS + "\n" + UTC, False),
        (PARIS + "\n", False),
        (format_call("get_weather", '{"city": "a                  b"}'), True),
        (format_call("get_weather", '{"city": "Oslo", "unit": "f"}'), True),
        (format_call("get_weather", '{ "city" : "Oslo" }'), False),
        (format_call("get_weather", '{"city":"Oslo"}'), False),
        (format_call("get_weather", '{\n  "city": "Oslo"\n}'), False),
        (format_call("get_weather", '{"unit": "f", "city": "Oslo"}'), False),
        ("", False),
        ("Sure! " + PARIS, False),
        (PARIS + " done", False),
        (format_call("get_weather", '{"unit": "c"}'), False),
        (format_call("get_weather", '{"city": "Paris", "unit": "k"}'), False),
        (format_call("get_weather", '{"city": "Paris", "x": 1}'), False),
        (format_call("get_weather", '{"city": 3}'), False),
        (format_call("ping", '{"a": 1}'), False),
        (format_call("get_wether", '{"city": "Paris"}'), False),
        (PARIS[:-1], False),
    ],
)
def test_required_parallel(compiler: Any, tokenizer: Any, text: str, ok: bool) -> None:
    plan = plan_for([WEATHER, TIME, NOARGS], tool_choice="required")
    assert _accepts(compiler, tokenizer, plan, text) is ok


def test_required_single_call_when_not_parallel(compiler: Any, tokenizer: Any) -> None:
    plan = plan_for([WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert _accepts(compiler, tokenizer, plan, PARIS)
    assert _accepts(compiler, tokenizer, plan, UTC)
    assert not _accepts(compiler, tokenizer, plan, PARIS + UTC)
    assert not _accepts(compiler, tokenizer, plan, PARIS + "\n")


def test_named_choice_allows_only_that_tool(compiler: Any, tokenizer: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    plan = plan_for([WEATHER, TIME], tool_choice=choice)
    assert _accepts(compiler, tokenizer, plan, UTC)
    assert _accepts(compiler, tokenizer, plan, UTC + UTC)
    assert not _accepts(compiler, tokenizer, plan, PARIS)
    single = plan_for([WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    assert not _accepts(compiler, tokenizer, single, UTC + UTC)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("", True),
        ("The weather is nice.", True),
        (PARIS, True),
        ("Let me check.\n" + PARIS, True),
        ("Checking " + PARIS + " and " + UTC + " done", True),
        ("Checking " + format_call("get_weather", '{"city": 1}'), False),
        (format_call("nope", "{}"), False),
        ("<tool_call>hello</tool_call>", False),
    ],
)
def test_auto_text_or_calls(compiler: Any, tokenizer: Any, text: str, ok: bool) -> None:
    plan = plan_for([WEATHER, TIME], tool_choice="auto")
    assert _accepts(compiler, tokenizer, plan, text) is ok


def test_auto_single_call_stops_after_it(compiler: Any, tokenizer: Any) -> None:
    plan = plan_for([WEATHER, TIME], parallel_tool_calls=False)
    assert _accepts(compiler, tokenizer, plan, "Let me look. " + PARIS)
    assert not _accepts(compiler, tokenizer, plan, PARIS + UTC)
    assert not _accepts(compiler, tokenizer, plan, PARIS + "\n" + UTC)


def test_token_level_walk(compiler: Any, tokenizer: Any) -> None:
    plan = plan_for([WEATHER, TIME], tool_choice="required")
    tag = tool_structural_tag(plan)
    assert matches(compiler, tokenizer, tag, PARIS + UTC, tokens=True)


def test_legacy_functions_constraint(compiler: Any, tokenizer: Any) -> None:
    plan = plan_for(None, functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert _accepts(compiler, tokenizer, plan, PARIS)
    assert not _accepts(compiler, tokenizer, plan, PARIS + "\n" + PARIS)
    assert not _accepts(compiler, tokenizer, plan, PARIS + PARIS)


def test_arguments_in_json_dumps_layout(compiler: Any, tokenizer: Any) -> None:
    nested = {
        "type": "function",
        "function": {
            "name": "plot",
            "parameters": {
                "type": "object",
                "properties": {
                    "points": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                    "style": {"type": "object", "properties": {"color": {"type": "string"}}},
                    "any": {},
                },
                "required": ["points"],
            },
        },
    }
    plan = plan_for([nested], tool_choice="required")
    arguments = {"points": [[1, 2.5], [-3, 0]], "style": {"color": "red"}, "any": {"k": [None, True, "x"]}}
    assert _accepts(compiler, tokenizer, plan, format_call("plot", json.dumps(arguments)))
    assert not _accepts(compiler, tokenizer, plan, format_call("plot", json.dumps(arguments, indent=2)))
    assert not _accepts(compiler, tokenizer, plan, format_call("plot", '{"points": [], "extra": 1}'))


@pytest.mark.parametrize("legacy", [False, True])
def test_schema_the_grammar_cannot_enforce_is_a_400(legacy: bool) -> None:
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}
    if legacy:
        plan = plan_for(None, functions=[WEATHER["function"], bad])
    else:
        plan = plan_for([WEATHER, {"type": "function", "function": bad}], tool_choice="required")
    with pytest.raises(APIError) as info:
        tool_structural_tag(plan)
    assert info.value.status == 400
    assert info.value.param == ("functions[1].parameters" if legacy else "tools[1].function.parameters")
    assert "'#/$defs/missing'" in info.value.message and "does not resolve" in info.value.message
