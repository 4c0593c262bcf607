"""Schemas of strings alone solved as one regular language (constraints/schema/string_sets.py):
``not`` / ``oneOf`` / ``anyOf`` / ``if`` over patterns, lengths and listed strings written as one
pattern, checked against jsonschema; an empty language is a 400; anything else is left alone."""

from __future__ import annotations

import itertools
import re

import jsonschema
import pytest

from constraints import ConstraintSpec, EmptyLanguageError
from constraints.schema.analysis import normalise_schema
from constraints.schema.string_sets import strings_only

from .conftest import walk_json

# MaskBench Handwritten allany12: "result will be ^[abcde]\d+[xyz]$" within 10 to 20 characters
CHAINED = {"type": "string", "allOf": [
    {"anyOf": [{"pattern": "^a"}, {"pattern": "^b"}, {"pattern": "^c"}]},
    {"anyOf": [{"allOf": [{"not": {"pattern": "^[ab]"}}, {"not": {"pattern": "^c"}}]}, {"pattern": "x$"},
               {"pattern": "y$"}]},
    {"anyOf": [{"not": {"pattern": "^[abc]"}}, {"pattern": "11"}, {"pattern": "222"}]},
    {"minLength": 3}, {"maxLength": 5}]}
ONE_OF = {"type": "string", "maxLength": 4, "oneOf": [{"pattern": "^a"}, {"pattern": "b$"}, {"enum": ["ab", "c"]}]}
CONDITIONAL = {"type": "string", "if": {"pattern": "^x"}, "then": {"minLength": 3}, "else": {"not": {"pattern": "z"}}}
LONG = {"type": "string", "minLength": 60, "allOf": [{"not": {"pattern": "a"}}, {"pattern": "^[ab]+$"}]}
ALPHABET = "abcxyz12"


def _strings(longest: int):
    for n in range(longest + 1):
        for chars in itertools.product(ALPHABET, repeat=n):
            yield "".join(chars)


@pytest.mark.parametrize("schema", [CHAINED, ONE_OF, CONDITIONAL], ids=["chained", "one-of", "if"])
def test_a_string_formula_is_one_exact_pattern(schema):
    solved = strings_only(normalise_schema(schema))
    assert set(solved) <= {"type", "pattern", "minLength", "maxLength"}
    pattern = re.compile(solved["pattern"])
    check = jsonschema.Draft202012Validator(schema).is_valid
    for text in _strings(5):
        mine = pattern.search(text) is not None and len(text) >= solved.get("minLength", 0)
        assert mine == check(text), text


def test_served_answers_follow_the_one_pattern(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", CHAINED))
    assert walk_json(compiled, tok, "a11x") and walk_json(compiled, tok, "b222y")
    assert not walk_json(compiled, tok, "a11") and not walk_json(compiled, tok, "a1x") and not walk_json(compiled, tok, "c1x")


def test_long_length_bounds_stay_beside_the_pattern(compiler, tok):
    solved = strings_only(normalise_schema(LONG))
    assert solved["minLength"] == 60 and re.fullmatch(solved["pattern"], "bbb")
    compiled = compiler.compile(ConstraintSpec("json_schema", LONG))
    assert walk_json(compiled, tok, "b" * 60) and not walk_json(compiled, tok, "b" * 59)


def test_no_string_is_a_400(compiler):
    empty = {"type": "string", "allOf": [{"pattern": "^a"}, {"not": {"pattern": "a"}}]}
    assert strings_only(normalise_schema(empty)) is False
    with pytest.raises(EmptyLanguageError, match="no string satisfies the schema"):
        compiler.compile(ConstraintSpec("json_schema", empty))


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^a"},  # one pattern, nothing negated: the backends take it as it is
    {"type": ["string", "null"], "not": {"pattern": "^a"}},  # not strings alone
    {"type": "string", "format": "email", "not": {"pattern": "^a"}},  # a keyword this module does not read
    {"type": "string", "not": {"pattern": "^[a-z]{70}$"}},  # too many states to write as one pattern
    {"type": "string", "allOf": [{"pattern": "^[a-z]{500}"}, {"not": {"pattern": "b"}}]},  # too large a DFA
])
def test_other_schemas_are_left_alone(schema):
    assert strings_only(normalise_schema(schema)) is None
