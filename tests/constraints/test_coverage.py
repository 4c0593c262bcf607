"""Keywords the backends skip, rewritten into enforced forms (constraints/schema/coverage.py):
valid instances are accepted token by token, invalid ones rejected, checked against jsonschema."""

from __future__ import annotations

import random

import jsonschema
import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError

from .conftest import allowed, assert_classified, closing_tokens, new_mask, random_walk, walk_json

CASES = [
    (
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
        [[], ["a"], ["c", "a"], ["b", "c", "a"]],
        [["a", "a"], ["a", "b", "a"], ["d"]],
    ),
    (
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
        [[True], [False, True]],
        [[], [True, True], [False, False]],
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 3}, "maxItems": 3},
        [[3], [1, 3], [3, 4, 2]],
        [[], [1, 2], [1, 2, -4], [3, 3, 3, 3]],
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10},
         "minContains": 2, "maxContains": 2, "maxItems": 4},
        [[10, 11], [1, 10, 2, 20]],
        [[10], [10, 11, 12], [1, 2, 3, 10]],
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        [{}, {"abc": 1}, {"x": [1], "y": None}],
        [{"Abc": 1}, {"a1": 2}, {"ok": 1, "NO": 2}],
    ),
    (
        {"type": "object", "properties": {"id": {"type": "integer"}, "ID": {"type": "integer"}},
         "propertyNames": {"pattern": "^[a-z]+$"}},
        [{"id": 1}, {"id": 1, "name": "x"}],
        [{"ID": 1}, {"id": "1"}],
    ),
    (
        {"type": "object", "propertyNames": {"enum": ["red", "green"]},
         "additionalProperties": {"type": "integer"}},
        [{}, {"red": 1}, {"red": 3, "green": 2}],
        [{"blue": 1}, {"red": "x"}],
    ),
    (  # the pattern takes the additionalProperties schema (MaskBench fabric.mod, sourcehut-build)
        {"type": "object", "propertyNames": {"pattern": "^[1-9][0-9]*$"}, "additionalProperties": {"type": "string"}},
        [{}, {"16": "a.png"}, {"1": "x", "32": ""}],
        [{"0": "x"}, {"16": 1}, {"a": "x"}, {"16": "x", "016": "y"}],
    ),
    (  # behind a $ref, beside listed names the pattern does not match
        {"type": "object", "$defs": {"key": {"type": "string", "pattern": "^[a-z]+$"}},
         "properties": {"ID": {"type": "integer"}, "Nb": {"type": "boolean"}},
         "propertyNames": {"$ref": "#/$defs/key"}, "additionalProperties": {"type": "integer"}},
        [{}, {"abc": 1}, {"abc": 1, "x": 2}],
        [{"ID": 1}, {"Nb": True}, {"abc": "1"}, {"Abc": 1}],
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
         "additionalProperties": False, "minProperties": 2, "maxProperties": 2},
        [{"a": 1, "b": 2}, {"b": 1, "c": 2}],
        [{"a": 1}, {"a": 1, "b": 2, "c": 3}],
    ),
    (
        {"type": "object", "patternProperties": {"^[a-c]$": {"type": "integer"}}, "additionalProperties": False,
         "minProperties": 2},
        [{"a": 1, "b": 2}, {"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}],
        [{"a": 1}, {"a": 1, "d": 2}, {"a": "x", "b": 1}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES,
                         ids=["unique-enum", "unique-bool", "contains", "min-max-contains", "names-pattern",
                              "names-pattern-known", "names-enum", "names-pattern-additional",
                              "names-pattern-ref", "min-max-properties",
                              "min-pattern-names"])
def test_rewritten_keyword_is_enforced(compiler, tok, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in valid:
        jsonschema.validate(value, schema)
        assert walk_json(compiled, tok, value), value
    for value in invalid:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value)
        assert not walk_json(compiled, tok, value), value


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        # bounded strings (unbounded ones are checked at run time: test_json_checks.py)
        ({"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "items": {"enum": list(range(8))}, "uniqueItems": True}, "uniqueItems"),
        # "integer" has no exact complement, needed to count matches on arrays longer than 5 items
        ({"type": "array", "contains": {"type": "integer"}, "maxContains": 2}, "maxContains"),
        # below patternProperties (an object holding a contains is written as a grammar, without them)
        ({"type": "object", "patternProperties": {"^a": {"contains": {"const": 3}}}}, "patternProperties"),
        ({"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}, "propertyNames"),
        # a listed name the pattern matches would take additionalProperties' schema too
        ({"type": "object", "properties": {"ab": {"type": "string"}}, "propertyNames": {"pattern": "^a"},
          "additionalProperties": {"type": "integer"}}, "propertyNames"),
        # keys beyond the listed ones, at no fixed path (run-time checks need one): llguidance
        # would count a repeated key toward the minimum
        ({"type": "object", "patternProperties": {"^x": {"type": "object", "minProperties": 2}}}, "minProperties"),
        # a closed map whose names end ("x1y" takes nothing after its y): a repeated name would
        # leave the key no way on (a map of endless names is checked: tests/constraints/test_json_checks.py)
        ({"type": "object", "patternProperties": {"^x[0-9]*y$": {}}, "additionalProperties": False,
          "minProperties": 2}, "minProperties"),
    ],
)
def test_beyond_the_exact_forms_is_still_refused(compiler, schema, keyword):
    with pytest.raises(UnsupportedConstraintError) as err:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert keyword in str(err.value)


@pytest.mark.parametrize(
    ("schema", "pointer", "reason"),
    [
        ({"properties": {"x": {"oneOf": [{"type": "integer"}, {"minimum": 2}]}}}, "/properties/x",
         "mutually exclusive"),
        ({"type": "object", "patternProperties": {"^x": {"properties": {"a": {}, "b": {}}, "minProperties": 2}}},
         "/patternProperties/^x", "all required"),
        # counting 600 matches needs more grammar states than a contains may take
        ({"properties": {"a": {"type": "array", "contains": {"type": "integer"}, "minContains": 600}}},
         "/properties/a", "reached from the root"),
    ],
)
def test_a_refusal_names_the_keyword_where_it_is_and_why(compiler, schema, pointer, reason):
    with pytest.raises(UnsupportedConstraintError) as err:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert err.value.pointer == pointer and f"at {pointer} " in str(err.value)
    assert reason in str(err.value)


# MaskBench Synthesized "…_not_2": a listed value set intersected with a keyword no backend
# enforces (not, multipleOf, patternProperties): the values that satisfy the whole node
FINITE_CASES = [
    ({"allOf": [{"enum": [5]}, {"not": {"enum": [2]}}]}, [5], [2, 6, "5"]),
    ({"allOf": [{"enum": [4, 1, 2]}, {"not": {"enum": [1, 2, 3]}}]}, [4], [1, 2, 3]),
    ({"allOf": [{"enum": [True]}, {"not": {"type": ["integer", "string"]}}]}, [True], [False, 1]),
    ({"enum": [{"a1b": None}, {"a31b": None}, {"X_1": 1}],
      "patternProperties": {"X_": {"type": "string"}, "[0-9]{2,}": {"type": "boolean"}}},
     [{"a1b": None}], [{"a31b": None}, {"X_1": 1}, {}]),
    ({"enum": [3, 4, 6, 7.5], "multipleOf": 1.5}, [3, 6, 7.5], [4, 1.5]),
    # MaskBench Synthesized draft2019_09_valid_ref_id33: a "$ref" that is an enum value, not a reference
    ({"allOf": [{"enum": ["this is a string"]},
                {"not": {"$defs": {"s": {"type": "string"}}, "enum": [{"$ref": "#/allOf/1/not/$defs/s"}]}}]},
     ["this is a string"], [{"$ref": "#/allOf/1/not/$defs/s"}, "other"]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), FINITE_CASES, ids=range(len(FINITE_CASES)))
def test_a_finite_value_set_is_filtered_by_the_whole_schema(compiler, tok, schema, valid, invalid):
    assert_classified(compiler, tok, schema, valid, invalid)


def test_a_finite_value_set_none_of_whose_values_is_valid_is_refused(compiler):
    from constraints import ConstraintError

    with pytest.raises(ConstraintError):
        compiler.compile(ConstraintSpec("json_schema", {"allOf": [{"const": 2}, {"not": {"enum": [2]}}]}))


def test_a_repeated_pattern_key_does_not_count_toward_min_properties(compiler, tok):
    """``{"a": 1, "a": 2}`` parses to one key: it must not meet ``minProperties: 2``."""
    from .conftest import walk_text

    schema = CASES[-1][0]
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_text(compiled, tok, '{"a": 1, "b": 2}')
    assert not walk_text(compiled, tok, '{"a": 1, "a": 2}')


def test_min_properties_met_by_required_keys_leaves_other_keys_open(compiler, tok):
    schema = {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "minProperties": 2}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(compiled, tok, {"a": 1, "b": 2, "c": 3})
    assert not walk_json(compiled, tok, {"a": 1})


# MaskBench Handwritten dep5: pattern-named keys, a minimum count and dependencies between keys;
# llguidance alone let `{"b": …, "d": …, ` through and then allowed no key at all. Named, the
# keys follow one order (a, b, c, d), as listed properties do, and every prefix can be completed.
DEPENDENT_KEYS = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object", "patternProperties": {"^[a-d]$": True}, "additionalProperties": False,
    "allOf": [{"dependencies": {"a": {"anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
                                "b": {"not": {"required": ["a"]}}, "c": {"not": {"required": ["a"]}}}},
              {"required": ["d"]}],
    "minProperties": 3,
}


def _prefix_allowed(compiled, tok, text: str) -> bool:
    matcher, mask = compiled.new_matcher(), new_mask()
    for t in tok.encode(text, add_special_tokens=False):
        mask.zero_()
        matcher.fill_bitmask(mask, 0)
        if not allowed(mask, t) or not matcher.accept_token(t):
            return False
        assert getattr(matcher, "error", None) is None
    return True


def test_pattern_named_keys_with_a_minimum_never_reach_a_dead_end(compiler, tok):
    check = jsonschema.Draft7Validator(DEPENDENT_KEYS).is_valid
    compiled = compiler.compile(ConstraintSpec("json_schema", DEPENDENT_KEYS))
    for value in ({"b": "x", "c": "z", "d": "y"}, {"b": 1, "c": [], "d": {}}):
        assert check(value) and walk_json(compiled, tok, value), value
    for value in ({"a": 1, "b": 2, "d": 3}, {"b": 1, "d": 2}, {"b": 1, "c": 2, "e": 3}):
        assert not check(value) and not walk_json(compiled, tok, value), value
    assert _prefix_allowed(compiled, tok, '{"b": "x", "c"')
    # the four named keys are few, and bound by presence: any order (key_presence.py), so c
    # can follow d; b excludes a, and two keys are too few
    assert _prefix_allowed(compiled, tok, '{"b": "x", "d": 1, "c"')
    assert not _prefix_allowed(compiled, tok, '{"b": "x", "a"')
    assert not _prefix_allowed(compiled, tok, '{"b": "x", "d": 1}')
    rng = random.Random(3)
    for _ in range(6):
        random_walk(compiled.new_matcher(), tok, rng, 60, closing_tokens(tok, '"},'), 0.7, check)


# The rewrites must speak the schema's draft: llguidance reads `$schema` and ignores keywords the
# draft does not have (`const` in draft-04, `prefixItems` before 2020-12), which would let an
# invalid instance through. MaskBench Github_medium o13137: a draft-04 oneOf over boolean enums.
DRAFT_CASES = [
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
      "properties": {"required": {"type": "boolean"}, "unique": {"type": "boolean"}},
      "oneOf": [{"properties": {"required": {"enum": [False]}, "unique": {"enum": [False]}}},
                {"properties": {"required": {"enum": [True]}, "unique": {"enum": [True, False]}}}]},
     [{"required": True}, {"required": False, "unique": False}, {"unique": True}],
     [{"unique": False}, {}, {"required": True, "unique": "x"}]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": {"type": "integer"},
      "contains": {"minimum": 3}, "maxItems": 3},
     [[3], [1, 3], [3, 4, 2]],
     [[], [1, 2], [1, 2, -4]]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), DRAFT_CASES, ids=["draft-04-oneOf", "draft-07-contains"])
def test_rewrites_use_keywords_of_the_schemas_draft(compiler, tok, schema, valid, invalid):
    assert_classified(compiler, tok, schema, valid, invalid)
