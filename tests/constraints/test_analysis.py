"""Emptiness analyses: regex anchors and classes, grammar productivity (no compiler needed)."""

from __future__ import annotations

import pytest

from constraints import EmptyLanguageError
from constraints.compile.grammar_analysis import (
    check_ebnf_productive,
    check_lark_productive,
    check_schema_productive,
    lark_rules,
    productive,
)
from constraints.regex.analysis import check_regex_nonempty, has_anchors


@pytest.mark.parametrize("regex", ["a^b", r"[^\s\S]", "a$b", r"[^\x00-\U0010FFFF]", "(a$)+b", "a{2,5}^", r"([^\d\D])+"])
def test_empty_regexes(regex):
    with pytest.raises(EmptyLanguageError):
        check_regex_nonempty(regex)


@pytest.mark.parametrize("regex", ["^abc$", "(a+)+$", "(^a|b)c", "(a$|b)c", "x(a$)*", r"([^\s\S])*", "$^", r"\p{L}+",
                                   r"(?<name>a)", "a{0,4294967294}"])
def test_nonempty_or_unknown_regexes(regex):
    check_regex_nonempty(regex)


def test_inner_anchors_are_seen():
    assert has_anchors("a$b") and has_anchors(r"\Aab") and has_anchors(r"\p{L}")  # unknown: no promise
    assert not has_anchors(r"(a+)+") and not has_anchors(r"[\^$]")


def test_productivity_fixpoint():
    rules = {
        "s": ("alt", [("seq", [("t",), ("ref", "s")]), ("ref", "a")]),
        "a": ("seq", [("ref", "b"), ("ref", "b")]),
        "b": ("alt", [("ref", "a"), ("plus", ("ref", "c"))]),
        "c": ("t",),
        "loop": ("seq", [("ref", "loop"), ("opt", ("ref", "c"))]),
    }
    assert productive(rules) == {"s", "a", "b", "c"}


@pytest.mark.parametrize("text, empty", [
    ('root ::= "a" root', True),
    ('root ::= "a" root | "b"', False),
    ('root ::= ("a" root)+', True),
    ('root ::= ("a" root)*', False),
    ('root ::= x "y"\nx ::= "(" x ")" | [a-z]', False),
    ('root ::= x\nx ::= y\ny ::= x', True),
    ("root ::= [", False),  # invalid: left to the backend
])
def test_ebnf(text, empty):
    if empty:
        with pytest.raises(EmptyLanguageError):
            check_ebnf_productive(text)
    else:
        check_ebnf_productive(text)


@pytest.mark.parametrize("text, empty", [
    ('start: "a" start', True),
    ('start: "a" start | "b"', False),
    ('?start: x+\nx: "(" x ")"\n  | "q"', False),
    ('start: x\nx: "a" x ~ 2', True),
    ('start: [x] "a"\nx: x', False),
    ('start: obj\nobj: "{" obj "}"\n%import common.WS\n%ignore WS', True),
    ('start: %json {"type": "object",\n  "properties": {"a": {"type": "string"}}}', False),
    ('%llguidance {}\nstart: A\nA: /[a-z]+/ | "a".."z"', False),
    ('start: <[128000]> x\nx: "x" x', True),
])
def test_lark(text, empty):
    assert lark_rules(text) is not None
    if empty:
        with pytest.raises(EmptyLanguageError):
            check_lark_productive(text)
    else:
        check_lark_productive(text)


def test_unknown_lark_syntax_is_left_to_the_backend():
    assert lark_rules("start: x\nx{a}: a") is None
    check_lark_productive("start: x\nx{a}: a")


@pytest.mark.parametrize("schema, empty", [
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, True),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"title": "A", "$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, True),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}}, False),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, False),
    ({"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}, False),
])
def test_schema_productivity(schema, empty):
    if empty:
        with pytest.raises(EmptyLanguageError):
            check_schema_productive(schema)
    else:
        check_schema_productive(schema)
