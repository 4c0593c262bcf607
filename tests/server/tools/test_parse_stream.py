"""parse_tool_output on whole texts, and ToolCallStreamer assembling exactly the same result
however the text is chunked."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from server.tools import (
    ToolCallStreamer,
    assistant_message,
    finish_reason,
    format_call,
    parse_tool_output,
)

from .toolcases import NOARGS, TIME, WEATHER, plan_for

TOOLS = [WEATHER, TIME, NOARGS]
PARIS = format_call("get_weather", '{"city": "Paris"}')
UTC = format_call("get_time", '{"zone":"UTC"}')
TRICKY_ARGS = '{"city": "a}</tool_call>\\"{[<tool_call>", "unit": "c"}'
TRICKY = format_call("get_weather", TRICKY_ARGS)

CASES = [
    ("required", PARIS),
    ("required", PARIS + "\n" + UTC),
    ("required", format_call("ping", "{}") + "\n" + TRICKY),
    ("auto", "The answer is 4."),
    ("auto", ""),
    ("auto", "  \n"),
    ("auto", "Let me check.\n" + PARIS),
    ("auto", "Checking " + PARIS + " and " + UTC + " done."),
    ("auto", "\n" + PARIS + "\n\n" + UTC + "\n"),
    ("auto", "a < b and <tool is not a call <tool_call"),
    ("auto", "<tool_call>not json</tool_call> then " + UTC),
    ("auto", format_call("unknown", "{}") + " text"),
    ("auto", '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}} oops'),
    ("auto", '<tool_call>{"name": "get_weather", "arguments": {"city": "x"'),
    ("auto", '<tool_call>{"name": "get_wea'),
    ("auto", "Über " + format_call("get_weather", '{"city": "Zürich 東京"}') + " ✓"),
    ("auto", '<tool_call> {"name" : "get_time" ,"arguments":{"zone": "CET"} } </tool_call>'),
    ("none", PARIS),
]
COMPLETE = [c for c in CASES if "oops" not in c[1] and not c[1].endswith(('"x"', "get_wea"))]


def _plan(mode: str, **fields: Any) -> Any:
    return plan_for(TOOLS, tool_choice=mode, **fields)


def _assemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, str]]]:
    """What an OpenAI client accumulates from the streamed deltas."""
    content: str | None = None
    calls: list[dict[str, str]] = []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            assert delta["content"]
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            if "id" in part:
                assert part["index"] == len(calls) and part["type"] == "function"
                assert re.fullmatch(r"call_[A-Za-z0-9]{24}", part["id"])
                calls.append({"name": part["function"]["name"], "arguments": ""})
                assert part["function"]["arguments"] == ""
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
        if "function_call" in delta:
            fc = delta["function_call"]
            if "name" in fc:
                calls.append({"name": fc["name"], "arguments": fc["arguments"]})
            else:
                calls[-1]["arguments"] += fc["arguments"]
    return content, calls


def _stream(text: str, plan: Any, cuts: list[int]) -> tuple[ToolCallStreamer, list[dict[str, Any]]]:
    streamer = ToolCallStreamer(plan)
    deltas: list[dict[str, Any]] = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        deltas += streamer.feed(text[a:b])
    return streamer, deltas + streamer.finish()


def _chunkings(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    out = [[], list(range(1, len(text)))]
    for _ in range(25):
        k = rng.randint(1, max(1, len(text) // 3))
        out.append(rng.sample(range(1, len(text)), min(k, max(0, len(text) - 1))))
    return out


def test_parse_single_call() -> None:
    content, calls = parse_tool_output(PARIS, _plan("required"))
    assert content is None and len(calls) == 1
    call = calls[0]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


def test_parse_keeps_text_and_order() -> None:
    content, calls = parse_tool_output("Checking " + PARIS + " and " + TRICKY + " done.", _plan("auto"))
    assert content == "Checking  and  done."
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[1].function.arguments)["city"] == 'a}</tool_call>"{[<tool_call>'
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',
        "<tool_call>",
    ],
)
def test_invalid_or_partial_calls_stay_content(text: str) -> None:
    assert parse_tool_output(text, _plan("auto")) == (text, [])
    assert parse_tool_output(text, _plan("required")) == (text, [])


def test_none_mode_and_no_plan_never_parse() -> None:
    assert parse_tool_output(PARIS, _plan("none")) == (PARIS, [])
    assert parse_tool_output(PARIS, None) == (PARIS, [])


def test_named_mode_parses_only_the_named_tool() -> None:
    plan = plan_for(TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    content, calls = parse_tool_output(UTC + "\n" + PARIS, plan)
    assert [c.function.name for c in calls] == ["get_time"] and content == "\n" + PARIS


def test_message_and_finish_reason() -> None:
    plan = _plan("auto")
    content, calls = parse_tool_output(PARIS, plan)
    message = assistant_message(content, calls, plan)
    assert message.content is None and message.tool_calls == calls and message.function_call is None
    assert finish_reason(plan, True, "stop") == "tool_calls"
    assert finish_reason(plan, False, "length") == "length"
    assert finish_reason(plan, True, "length") == "length"  # cut short: the calls may be incomplete
    assert finish_reason(None, False, "stop") == "stop"


def test_legacy_answer_shape() -> None:
    plan = plan_for(None, functions=[WEATHER["function"]])
    content, calls = parse_tool_output(PARIS, plan)
    message = assistant_message(content, calls, plan)
    assert message.tool_calls is None and message.function_call is not None
    assert message.function_call.name == "get_weather"
    assert finish_reason(plan, True, "stop") == "function_call"
    _, deltas = _stream(PARIS, plan, [5, 30, 50])
    assert all(set(d) <= {"function_call"} for d in deltas)
    assert _assemble(deltas) == (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])


@pytest.mark.parametrize(("mode", "text"), COMPLETE)
def test_stream_assembles_the_parsed_result(mode: str, text: str) -> None:
    for parallel in (True, False):
        plan = _plan(mode, parallel_tool_calls=parallel)
        content, calls = parse_tool_output(text, plan)
        expected_calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
        for cuts in _chunkings(text):
            streamer, deltas = _stream(text, plan, cuts)
            got_content, got_calls = _assemble(deltas)
            assert got_calls == expected_calls, cuts
            assert (got_content or "") == (content or ""), cuts
            assert (got_content is None) == (content is None) or content == ""
            assert streamer.has_calls == bool(calls)


def test_stream_emits_arguments_incrementally() -> None:
    streamer = ToolCallStreamer(_plan("required"))
    first = streamer.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    second = {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}
    assert streamer.feed('ty": "Oslo"}') == [second]
    assert streamer.feed("}</tool_call>") == [] and streamer.finish() == []


def test_stream_holds_back_a_possible_trigger() -> None:
    streamer = ToolCallStreamer(_plan("auto"))
    assert streamer.feed("Hi <tool") == [{"content": "Hi "}]
    assert streamer.feed("box>") == [{"content": "<toolbox>"}]
    assert streamer.feed(" <") == []  # whitespace waits for more content
    assert streamer.finish() == [{"content": " <"}]


@pytest.mark.parametrize(
    "text",
    [c[1] for c in CASES if c not in COMPLETE]
    + ['<tool_call>{"name": "ping", "arguments": {"a": [1, {"b": "}"}]', "x" * 5 + "<tool_call>{"],
)
def test_stream_truncated_output_never_raises(text: str) -> None:
    for cuts in _chunkings(text):
        _, deltas = _stream(text, _plan("auto"), cuts)
        content, calls = _assemble(deltas)
        pieces = (content or "") + "".join(c["arguments"] for c in calls)
        assert len(pieces) <= len(text)
