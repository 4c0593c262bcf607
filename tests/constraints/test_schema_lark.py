"""contains / minContains / maxContains on arrays of any length, compiled as llguidance Lark
grammars (constraints/schema/lark.py): valid instances (judged by jsonschema) pass the mask and
accept token by token in the request's layout, invalid ones fail; what has no exact form is
refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.schema.lark import needs_lark

from .conftest import walk_text

CASES = [
    (  # nested contains: some item is an array holding 42
        "nested",
        {"type": "array", "items": {"type": "array"}, "contains": {"contains": {"const": 42}}},
        [[[42]], [[], [1, 42], ["x"]], [[1], [2, 3, 42, 4]]],
        [[], [[]], [[1], [2]], [42], [[1], 42]],
    ),
    (  # items and contains through $ref / allOf (MaskBench Handwritten itemscontains1)
        "allof-refs",
        {"type": "array", "allOf": [{"items": {"$ref": "#/definitions/inside1"}},
                                    {"contains": {"$ref": "#/definitions/inside2"}}],
         "definitions": {"inside1": {"type": "array", "items": {"type": "number", "multipleOf": 11, "minimum": 100}},
                         "inside2": {"type": "array", "contains": {"type": "number", "multipleOf": 3}}}},
        [[[132]], [[110], [121, 165, 110]], [[], [110, 132]]],
        [[], [[110]], [[132], [3]], [[99]], [132]],
    ),
    (  # minContains and maxContains with items, no type: other types pass untouched
        "min-max",
        {"items": {"type": ["integer", "string"]}, "contains": {"type": "string"}, "minContains": 2, "maxContains": 3},
        [["a", "b"], [1, "a", 2, "b", "c", 3, 4, 5], "text", 7, {"k": [1]}],
        [[], ["a"], ["a", "b", "c", "d"], [1, 2, 3], ["a", "b", None], ["a", 1.5, "b"]],
    ),
    (  # minItems / maxItems beside a count
        "items-bounds",
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10}, "minContains": 2,
         "minItems": 3, "maxItems": 7},
        [[10, 11, 0], [1, 2, 3, 4, 5, 10, 20], [50, 60, 70]],
        [[10, 11], [1, 2, 3, 4, 5, 6, 10, 20], [10, 1, 2], [10, 11, "x"]],
    ),
    (  # two contains clauses (allOf), one with a maximum
        "two-clauses",
        {"type": "array", "allOf": [{"contains": {"const": "a"}},
                                    {"contains": {"type": "number"}, "maxContains": 1}]},
        [["a", 1], [2, "b", "a", "a"], ["a", 1, "a"]],
        [[], ["a"], [1], ["a", 1, 2], ["b", 1]],
    ),
    (  # anyOf over a contains: either branch
        "anyof",
        {"type": "array", "anyOf": [{"contains": {"const": 1}}, {"items": {"type": "string"}, "minItems": 1}]},
        [[1], [0, 1, "x"], ["x", "y"]],
        [[], [0], [0, "x"]],
    ),
    (  # not items = contains the negation, on arrays of any length
        "not-items",
        {"type": "array", "items": {"not": {"items": {"type": "string"}}}},
        [[], [[1]], [["a", 2], [None, "b"], [["c"]]]],
        [[[]], [["a"]], [[1], ["a", "b"]], [1]],
    ),
    (  # maxContains 0: no item matches (nothing counted)
        "max-zero",
        {"type": "array", "contains": {"type": "null"}, "minContains": 0, "maxContains": 0, "maxItems": 40},
        [[], [1, "a", [None]], [{}] * 3],
        [[None], [1, None]],
    ),
]


def _texts(value, layout: str | None) -> list[str]:
    if layout == "compact":
        return [json.dumps(value, separators=(",", ":"))]
    if layout == "flexible":
        return [json.dumps(value), json.dumps(value, indent=2)]
    return [json.dumps(value)]


@pytest.mark.parametrize(("name", "schema", "valid", "invalid"), CASES, ids=[c[0] for c in CASES])
def test_contains_enforced_exactly(compiler, tok, name, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert compiled.backend == "llguidance"
    validator = jsonschema.validators.validator_for(schema)(schema)
    for value in valid:
        assert validator.is_valid(value), value
        assert walk_text(compiled, tok, json.dumps(value)), value
    for value in invalid:
        assert not validator.is_valid(value), value
        assert not walk_text(compiled, tok, json.dumps(value)), value


@pytest.mark.parametrize("layout", ["compact", "flexible", "dumps"])
def test_contains_grammar_follows_the_layout(compiler, tok, layout):
    schema = {"type": "array", "items": {"type": "object"}, "contains": {"required": ["id"]}}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, {"json_layout": layout}))
    value = [{"a": 1, "b": [1, 2]}, {"id": 3}]
    for text in _texts(value, layout):
        assert walk_text(compiled, tok, text), text
    assert not walk_text(compiled, tok, json.dumps([{"a": 1}]))
    if layout != "flexible":  # the other layouts are exact: no other spacing
        other = json.dumps(value) if layout == "compact" else json.dumps(value, separators=(",", ":"))
        assert not walk_text(compiled, tok, other)


@pytest.mark.parametrize(("schema", "keyword"), [
    # the non-matching items must be told apart: "integer" has no exact complement (number but not integer)
    ({"type": "array", "contains": {"type": "integer"}, "maxContains": 2}, "maxContains"),
    ({"type": "array", "contains": {"const": 1}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}, "prefixItems": [{"type": "integer"}]}, "prefixItems"),
    # oneOf over contains (MaskBench Handwritten oneofanyofitc1): "not multipleOf" has no exact form
    ({"type": "array", "oneOf": [{"contains": {"multipleOf": 3}}, {"contains": {"multipleOf": 5}}]}, "oneOf"),
    # inside an object property: the object would have to be written as Lark too
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "contains"),
])
def test_unsupported_forms_are_refused_by_name(compiler, schema, keyword):
    with pytest.raises(UnsupportedConstraintError, match=repr(keyword)):
        compiler.compile(ConstraintSpec("json_schema", schema))


def test_only_schemas_with_contains_take_the_grammar_path():
    assert needs_lark({"definitions": {"a": {"contains": {}}}})
    assert not needs_lark({"type": "array", "items": {"type": "integer"}, "maxItems": 3})


def _random_value(rng, depth: int = 0):
    pick = rng.randrange(7 if depth < 2 else 5)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice([0, 1, 3, 10, 42, 132, -5])
    if pick == 2:
        return rng.choice([1.5, 110, 121.0])
    if pick in (3, 4):
        return rng.choice(["a", "b", "", "id"])
    if pick == 5:
        return {rng.choice(["id", "k"]): _random_value(rng, depth + 1) for _ in range(rng.randrange(2))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


RANDOM_CASES = [(c[0], c[1]) for c in CASES if c[0] in ("nested", "min-max", "two-clauses")]


@pytest.mark.parametrize(("name", "schema"), RANDOM_CASES)
def test_random_arrays_agree_with_jsonschema_and_mask(compiler, tok, name, schema):
    """Random arrays: accepted iff jsonschema says valid, and the mask agrees with accept_token at
    every step (sampled tokens beside the instance's own)."""
    import random

    from .test_mask_accept import _disagreements

    rng = random.Random(name)
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    validator = jsonschema.validators.validator_for(schema)(schema)
    seen = {True: 0, False: 0}
    for _ in range(40):
        value = [_random_value(rng) for _ in range(rng.randrange(6))]
        ids = tok.encode(json.dumps(value), add_special_tokens=False)
        assert walk_text(compiled, tok, json.dumps(value)) == validator.is_valid(value), value
        assert not _disagreements(compiled.new_matcher(), ids, rng), value
        seen[validator.is_valid(value)] += 1
    assert seen[False] > 0
