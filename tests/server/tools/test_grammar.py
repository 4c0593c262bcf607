"""The structural tag compiles with xgrammar for the default tokenizer and accepts exactly the
calls the plan allows."""

from __future__ import annotations

from typing import Any

import pytest

from server.tools import format_call, tool_constraint_spec, tool_structural_tag

from .toolcases import NOARGS, TIME, WEATHER, matches, plan_for

PARIS = format_call("get_weather", '{"city": "Paris", "unit": "c"}')
UTC = format_call("get_time", '{"zone":"UTC"}')
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
        (format_call("get_weather", '{ "city" : "Oslo" }'), True),
        (format_call("get_weather", '{"city":' + " " * 16 + '"a                  b"}'), True),
        (format_call("get_weather", '{"city":' + " " * 17 + '"Oslo"}'), False),
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
