"""Per-family formats: selection (flag, template detection, fallback), the grammar of each JSON
family accepting exactly the calls its own parser reads back, and the streamed/non-streamed
OpenAI shapes built from a parser."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from server.tools import tool_structural_tag
from server.tools.formats import detect_format, format_names, get_format
from server.tools.output import ChoiceStreamer, parse_choice
from server.tools.select import choose_format

from .toolcases import TIME, WEATHER, matches, plan_for

JSON_FAMILIES = ["qwen3-hermes", "llama", "mistral", "deepseek", "kimi", "gpt-oss"]
XML_FAMILIES = ["qwen3-xml", "glm"]
PARIS = '{"city": "Paris", "unit": "c"}'


def _plan(family: str, **fields: Any) -> Any:
    return dataclasses.replace(plan_for([WEATHER, TIME], **fields), format_name=family)


def _call_text(family: str, name: str, arguments: str) -> str:
    """One call as the family's grammar writes it (its tag's begin + arguments + end)."""
    tag = get_format(family).call_tag(name, {}) if family != "qwen3-hermes" else None
    if tag is None:
        from server.tools.format import format_call

        return format_call(name, arguments)
    return tag["begin"] + arguments + tag["end"]


def test_every_family_is_registered() -> None:
    assert format_names() == sorted(
        ["qwen3-hermes", "qwen3-xml", "llama", "mistral", "deepseek", "kimi", "glm", "gpt-oss", "gemma4"]
    )


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{% if tools %}<tool_call>\n{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}", "qwen3-hermes"),
        ("{% if tools %}<tool_call>\n<function=x>\n<parameter=y>{% endif %}", "qwen3-xml"),
        ("<|start_header_id|>{% if tools %}ipython{% endif %}", "llama"),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
        ("<｜tool▁calls▁begin｜>", "deepseek"),
        ("<|tool_calls_section_begin|>", "kimi"),
        ("<tool_call>{{ name }}<arg_key>k</arg_key>", "glm"),
        ("<|start|>assistant<|channel|>final<|message|>", "gpt-oss"),
        ("<|tool_call>call:", "gemma4"),
    ],
)
def test_detect_from_template(template: str, family: str) -> None:
    found = detect_format(template)
    assert found is not None and found.name == family


def test_unknown_template_falls_back_and_flag_overrides(tokenizer: Any) -> None:
    fmt, how = choose_format("", tokenizer)  # SmolLM2: no tool markup in its template
    assert (fmt.name, how) == ("qwen3-hermes", "default")
    fmt, how = choose_format("mistral", tokenizer)
    assert (fmt.name, how) == ("mistral", "flag")


@pytest.mark.parametrize("family", JSON_FAMILIES)
def test_required_grammar_accepts_what_the_parser_reads(compiler: Any, tokenizer: Any, family: str) -> None:
    plan = _plan(family, tool_choice="required")
    tag = tool_structural_tag(plan)
    text = _call_text(family, "get_weather", PARIS)
    assert matches(compiler, tokenizer, tag, text)
    assert not matches(compiler, tokenizer, tag, "Hello")
    assert not matches(compiler, tokenizer, tag, _call_text(family, "get_weather", '{"unit": "c"}'))  # city required
    content, _, calls = parse_choice(get_format(family), plan, text, "")
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", json.loads(PARIS))]


@pytest.mark.parametrize("family", JSON_FAMILIES)
def test_named_and_single_call_grammar(compiler: Any, tokenizer: Any, family: str) -> None:
    named = _plan(family, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not matches(compiler, tokenizer, tool_structural_tag(named), _call_text(family, "get_weather", PARIS))
    single = _plan(family, tool_choice="required", parallel_tool_calls=False)
    one = _call_text(family, "get_weather", PARIS)
    assert matches(compiler, tokenizer, tool_structural_tag(single), one)
    assert not matches(compiler, tokenizer, tool_structural_tag(single), one + one)


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek", "kimi"])
def test_auto_grammar_is_free_until_the_trigger(compiler: Any, tokenizer: Any, family: str) -> None:
    tag = tool_structural_tag(_plan(family, tool_choice="auto"))
    assert matches(compiler, tokenizer, tag, "The weather is fine.")
    call = get_format(family).auto_prefix + _call_text(family, "get_weather", PARIS)
    assert matches(compiler, tokenizer, tag, "Let me see. " + call)


XML_CALLS = {
    "qwen3-xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>",
}


@pytest.mark.parametrize("family", XML_FAMILIES)
def test_xml_grammar_accepts_what_the_parser_reads(compiler: Any, tokenizer: Any, family: str) -> None:
    """XML-parameter families are constrained by xgrammar's matching JSON-Schema style: the
    grammar takes only schema-valid calls, and the parser reads them back with typed values."""
    plan = _plan(family, tool_choice="required")
    tag = tool_structural_tag(plan)
    text = XML_CALLS[family]
    assert matches(compiler, tokenizer, tag, text)
    assert not matches(compiler, tokenizer, tag, "Hello")
    assert not matches(compiler, tokenizer, tag, text.replace(">c<", ">kelvin<").replace("\nc\n", "\nkelvin\n"))
    content, _, calls = parse_choice(get_format(family), plan, text, "")
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", json.loads(PARIS))]


@pytest.mark.parametrize("family", JSON_FAMILIES)
def test_stream_equals_whole_for_any_split(family: str) -> None:
    fmt = get_format(family)
    plan = _plan(family, tool_choice="auto")
    text = "Checking. " + get_format(family).auto_prefix + _call_text(family, "get_weather", PARIS)
    content, reasoning, calls = parse_choice(fmt, plan, text, "")
    assert [c.function.name for c in calls] == ["get_weather"]
    for size in (1, 2, 5, len(text)):
        streamer = ChoiceStreamer(fmt, plan, "")
        deltas = [d for i in range(0, len(text), size) for d in streamer.feed(text[i : i + size])] + streamer.finish()
        got = "".join(d.get("content", "") for d in deltas)
        streamed_calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert got == (content or "")
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == [
            (0, "get_weather", calls[0].function.arguments)
        ]
        assert all(c["id"].startswith("call_") for c in streamed_calls)


def test_reasoning_is_split_out_and_prefilled_think_is_seen() -> None:
    fmt = get_format("qwen3-hermes")
    content, reasoning, calls = parse_choice(fmt, None, "I think so.\n</think>\n\nYes.", "<|im_start|>assistant\n<think>\n")
    assert (content, reasoning, calls) == ("Yes.", "I think so.", [])
    streamer = ChoiceStreamer(fmt, None, "<|im_start|>assistant\n<think>\n")
    deltas = [d for ch in "I think so.\n</think>\n\nYes." for d in streamer.feed(ch)] + streamer.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I think so."
    assert "".join(d.get("content", "") for d in deltas) == "Yes."


def test_unoffered_tool_and_cut_call_stay_text() -> None:
    fmt = get_format("mistral")
    plan = _plan("mistral", tool_choice="auto")
    content, _, calls = parse_choice(fmt, plan, '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}', "")
    assert calls == [] and content == '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}'
    content, _, calls = parse_choice(fmt, plan, '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "")
    assert calls == [] and "get_weather" in (content or "")


@pytest.mark.parametrize(
    ("switches", "content", "reasoning"),
    [
        ({}, "Yes.", "Hmm."),
        ({"separate": False}, "Hmm.Yes.", None),
        ({"include": False}, "Yes.", None),
    ],
)
def test_reasoning_output_switches(switches: dict[str, bool], content: str, reasoning: str | None) -> None:
    from server.tools.output import ReasoningOutput

    fmt = get_format("qwen3-hermes")
    got = parse_choice(fmt, None, "<think>Hmm.</think>Yes.", "", ReasoningOutput(**switches))
    assert got[:2] == (content, reasoning)


def test_stream_reasoning_false_sends_reasoning_once() -> None:
    from server.tools.output import ReasoningOutput

    streamer = ChoiceStreamer(get_format("qwen3-hermes"), None, "", ReasoningOutput(stream=False))
    deltas = [d for ch in "<think>a b c</think>done" for d in streamer.feed(ch)] + streamer.finish()
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert reasoning == ["a b c"]
    assert "".join(d.get("content", "") for d in deltas) == "done"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3-xml", "glm", "gemma4", "gpt-oss"])
def test_default_prompt_writes_calls_in_the_chosen_format(family: str) -> None:
    """A template without tool support, with a format chosen by --tool-call-format: the system
    prompt's example and earlier calls are written in that format, and read back by its parser."""
    from server.protocol import ChatMessage
    from server.tools import render_messages

    plan = _plan(family, tool_choice="auto")
    history = [
        ChatMessage(role="user", content="Paris?"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}],
        ),
        ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
    ]
    messages, tools = render_messages(history, plan, template_supports_tools=False)
    assert tools is None
    assert "<tool_call>{" not in messages[0]["content"]
    written = messages[2]["content"]
    _, _, calls = parse_choice(get_format(family), plan, written, "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", json.loads(PARIS))]


def test_a_failing_parser_returns_the_text_as_content(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.tools.formats.hermes import HermesParser

    def broken(self, text):  # noqa: ANN001
        raise RuntimeError("bug")

    monkeypatch.setattr(HermesParser, "feed", broken)
    fmt = get_format("qwen3-hermes")
    assert parse_choice(fmt, None, "hello", "")[0] == "hello"
    streamer = ChoiceStreamer(fmt, None, "")
    deltas = streamer.feed("hel") + streamer.feed("lo") + streamer.finish()
    assert "".join(d.get("content", "") for d in deltas) == "hello"


_PIECES = [
    "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', '"name"', ":", ",", "<think>", "</think>",
    "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<function=", "<parameter=", "</parameter>", "</function>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|channel|>", "<|message|>", "<|call|>",
    "<|end|>", "<|start|>", "to=functions.f", "<|tool_call>", "<tool_call|>", '<|"|>', "call:f",
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|tool_calls_section_end|>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
    "<｜DSML｜", "<|open|>", "<|close|>", "<|sep|>", "f", " ", "\n", "1", "a", "(", ")", "=", "'",
]


@pytest.mark.parametrize("family", format_names())
def test_random_marker_soup_never_raises_and_streams_the_same(family: str) -> None:
    import random

    from server.tools.formats import ParserOptions

    fmt = get_format(family)
    rng = random.Random(family)
    for _ in range(300):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 30)))
        options = ParserOptions(names=frozenset({"f"}), in_reasoning=rng.random() < 0.3, variant=rng.choice(["", "k3"]))
        whole = fmt.parser(options).parse(text)
        parser = fmt.parser(options)
        size = rng.randint(1, 6)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])] + parser.finish()
        from server.tools.formats.base import merge_events

        assert merge_events(events) == whole, text


@pytest.mark.parametrize("family", ["qwen3-hermes", "qwen3-xml", "glm", "kimi", "deepseek"])
def test_call_right_after_a_prefilled_think_is_a_call(family: str) -> None:
    """The prompt opened reasoning but a forced call starts at once: the call opener ends the
    reasoning segment, so the call is read as a call, not as reasoning text."""
    fmt = get_format(family)
    plan = _plan(family, tool_choice="required")
    text = XML_CALLS.get(family) or _call_text(family, "get_weather", PARIS)
    content, reasoning, calls = parse_choice(fmt, plan, text, "<|assistant|><think>")
    assert reasoning is None and content is None
    assert [c.function.name for c in calls] == ["get_weather"]
