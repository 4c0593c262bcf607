"""Gemma 4's call grammar: it accepts exactly the calls its parser reads back as schema-valid
arguments (hand-written cases both ways, and random walks through the compiled grammar whose
every finished text the parser must read as valid calls), and refuses schemas it cannot write."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from typing import Any

import pytest
from jsonschema.validators import validator_for

from server.errors import APIError
from server.tools import tool_structural_tag
from server.tools.formats import get_format
from server.tools.formats.gemma4_grammar import notation
from server.tools.output import parse_choice

from .toolcases import TIME, WEATHER, matches, plan_for

RICH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 12},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "ratio": {"type": "number"},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b c"]}, "maxItems": 3},
        "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False},
        "owner": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/person"}]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "note": {"type": "string"},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
    "$defs": {
        "person": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "boss": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/person"}]}},
            "required": ["name"],
            "additionalProperties": False,
        }
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": RICH}}

VALID = [
    {"query": "x", "limit": 1},
    {"query": "a<b", "limit": 50, "ratio": -0.5e3, "exact": False, "note": "a<b <|c <|\"|"},
    {"query": "two\nlines", "limit": 7, "tags": [], "point": [1, 2.5]},
    {"query": "q", "limit": 3, "tags": ["b c", "a"], "owner": None, "code": "AB12"},
    {"query": "q", "limit": 3, "owner": {"name": "Ann", "boss": {"name": "Bo", "boss": None}}},
    {"query": "q", "limit": 3, "note": 'has "quotes", {braces}: and <tool_call|> inside', "meta": {"k": 1, "n_2": -4}},
    {"query": "q", "limit": 3, "note": ""},
]
INVALID = [
    {"limit": 1},  # query required
    {"query": "", "limit": 1},  # minLength
    {"query": "x" * 13, "limit": 1},  # maxLength
    {"query": "x", "limit": 0},  # minimum
    {"query": "x", "limit": 1.5},  # integer
    {"query": "x", "limit": 1, "tags": ["c"]},  # enum
    {"query": "x", "limit": 1, "tags": ["a", "a", "a", "a"]},  # maxItems
    {"query": "x", "limit": 1, "point": [1]},  # both prefix items
    {"query": "x", "limit": 1, "code": "ab12"},  # pattern
    {"query": "x", "limit": 1, "owner": {"boss": None}},  # nested required
    {"query": "x", "limit": 1, "extra": 1},  # undeclared
    {"query": "a|b", "limit": 1},  # no "|" in a length-bounded string (see gemma4_grammar)
    {"limit": 1, "query": "x"},  # out of the schema's order (one fixed layout)
]


def _plan(tools: list[dict[str, Any]], **fields: Any) -> Any:
    return dataclasses.replace(plan_for(tools, **fields), format_name="gemma4")


def _call(name: str, arguments: dict[str, Any]) -> str:
    return get_format("gemma4").call_text(name, json.dumps(arguments))


def _read(plan: Any, text: str) -> list[tuple[str, Any]]:
    content, _, calls = parse_choice(get_format("gemma4"), plan, text, "")
    assert content is None, content
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_required_call_is_read_back(compiler: Any, tokenizer: Any) -> None:
    plan = _plan([WEATHER, TIME], tool_choice="required")
    tag = tool_structural_tag(plan)
    text = _call("get_weather", {"city": "Paris", "unit": "c"})
    assert text == '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|>'
    assert matches(compiler, tokenizer, tag, text)
    assert matches(compiler, tokenizer, tag, text + _call("get_time", {"zone": "UTC"}))  # parallel
    assert not matches(compiler, tokenizer, tag, "Hello")
    assert not matches(compiler, tokenizer, tag, _call("get_weather", {"unit": "c"}))  # city required
    assert not matches(compiler, tokenizer, tag, _call("get_weather", {"city": "Paris", "unit": "k"}))
    assert not matches(compiler, tokenizer, tag, '<|tool_call>call:get_weather{"city":"Paris"}<tool_call|>')
    assert not matches(compiler, tokenizer, tag, '<|tool_call>call:get_weather{city: <|"|>Paris<|"|>}<tool_call|>')
    assert _read(plan, text) == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_named_and_single_call(compiler: Any, tokenizer: Any) -> None:
    named = _plan([WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not matches(compiler, tokenizer, tool_structural_tag(named), _call("get_weather", {"city": "Paris"}))
    assert matches(compiler, tokenizer, tool_structural_tag(named), _call("get_time", {"zone": "UTC"}))
    single = tool_structural_tag(_plan([WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    one = _call("get_weather", {"city": "Paris"})
    assert matches(compiler, tokenizer, single, one)
    assert not matches(compiler, tokenizer, single, one + one)


def test_auto_is_free_until_the_call_opens(compiler: Any, tokenizer: Any) -> None:
    tag = tool_structural_tag(_plan([WEATHER, TIME], tool_choice="auto"))
    assert tag is not None
    assert matches(compiler, tokenizer, tag, "The weather is fine.")
    assert matches(compiler, tokenizer, tag, "Let me see. " + _call("get_weather", {"city": "Paris"}))
    assert not matches(compiler, tokenizer, tag, "Let me see. <|tool_call>call:get_weather{}<tool_call|>")


@pytest.mark.parametrize("arguments", VALID)
def test_valid_arguments_match_and_read_back(compiler: Any, tokenizer: Any, arguments: dict[str, Any]) -> None:
    validator_for(RICH)(RICH).validate(arguments)
    plan = _plan([SEARCH], tool_choice="required")
    text = _call("search", arguments)
    assert matches(compiler, tokenizer, tool_structural_tag(plan), text), text
    assert _read(plan, text) == [("search", arguments)]


@pytest.mark.parametrize("arguments", INVALID)
def test_invalid_arguments_do_not_match(compiler: Any, tokenizer: Any, arguments: dict[str, Any]) -> None:
    tag = tool_structural_tag(_plan([SEARCH], tool_choice="required"))
    assert not matches(compiler, tokenizer, tag, _call("search", arguments))


def test_string_delimiter_cannot_appear_inside_a_string(compiler: Any, tokenizer: Any) -> None:
    tag = tool_structural_tag(_plan([TIME], tool_choice="required"))
    assert matches(compiler, tokenizer, tag, '<|tool_call>call:get_time{zone:<|"|><|"<|"|>}<tool_call|>')
    assert not matches(compiler, tokenizer, tag, '<|tool_call>call:get_time{zone:<|"|>a<|"|>b<|"|>}<tool_call|>')


def test_random_walks_through_the_grammar_read_back_valid(compiler: Any, tokenizer: Any) -> None:
    """Texts the grammar lets a model write (random allowed tokens, to the end) are parsed as
    calls whose arguments validate: the grammar never produces what the parser rejects."""
    import numpy as np
    import xgrammar as xgr

    plan = _plan([SEARCH, WEATHER], tool_choice="required")
    compiled = compiler.compile_structural_tag(json.dumps(tool_structural_tag(plan)))
    validators = {"search": validator_for(RICH)(RICH), "get_weather": validator_for(WEATHER["function"]["parameters"])(WEATHER["function"]["parameters"])}
    rng = random.Random(0)
    vocab = compiled.tokenizer_info.vocab_size
    short = {t for t in range(len(tokenizer)) if len(tokenizer.decode([t])) <= 2} - {tokenizer.eos_token_id}
    # whole pieces of markup, tried often so that values close and walks end
    markup = ['<|"|>', "}", "]", "<tool_call|>", ",", "null", "true", "1", "[", "{", ":", "<", "<|"]
    finished = 0
    for _ in range(10):
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        parts: list[str | int] = []  # markup strings and token ids (decoded together: a token may hold part of a character)
        for _step in range(500):
            if rng.random() < 0.6:
                piece = rng.choice(markup)
                if matcher.accept_string(piece):
                    parts.append(piece)
                continue
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(bits).tolist()
            if tokenizer.eos_token_id in allowed and rng.random() < 0.5:
                break
            token = rng.choice([t for t in allowed if t in short] or allowed)
            assert matcher.accept_token(token)
            parts.append(token)
        else:
            continue
        finished += 1
        text = "".join(
            "".join(run) if isinstance(run[0], str) else tokenizer.decode(list(run))
            for _, run in ((k, list(g)) for k, g in itertools.groupby(parts, key=lambda p: isinstance(p, str)))
        )
        calls = _read(plan, text)
        assert calls, text
        for name, arguments in calls:
            assert validators[name].is_valid(arguments), (text, arguments)
    assert finished >= 4


@pytest.mark.parametrize(
    ("parameters", "why"),
    [
        ({"type": "object", "properties": {"a b:": {"type": "string"}}}, "cannot be written bare"),
        ({"type": "object", "properties": {"s": {"enum": ['a<|"|>b']}}}, "cannot be written"),
    ],
)
def test_unwritable_schemas_are_a_400(parameters: dict[str, Any], why: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(APIError) as err:
        tool_structural_tag(_plan([tool], tool_choice="required"))
    assert err.value.param == "tools[0].function.parameters" and why in err.value.message


def test_notation_matches_the_parser() -> None:
    from server.tools.formats.gemma4 import to_json

    for value in VALID:
        assert to_json(notation(value)) == value
