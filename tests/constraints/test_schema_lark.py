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


OBJECT_CASES = [
    (  # listed, required and additional properties: the additional ones typed, after the listed
        "additional-schema",
        {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}, "b": {"type": "integer"}},
         "required": ["b"], "additionalProperties": {"type": "string"}},
        [{"b": 1}, {"a": [0, 1], "b": 2}, {"b": 3, "c": "x", "d": ""}, {"a": [1], "b": 0, "é": "y"}],
        [{}, {"a": [1]}, {"a": [2], "b": 1}, {"b": 1, "c": 2}, {"b": "x"}, [1], "s"],
    ),
    (  # additionalProperties false; no type: other values pass as they are
        "closed",
        {"properties": {"xs": {"type": "array", "items": {"type": "string"}, "contains": {"const": "k"}},
                        "n": {"type": "null"}}, "additionalProperties": False},
        [{}, {"xs": ["k"]}, {"xs": ["a", "k"], "n": None}, [0], 7, "t", None],
        [{"xs": []}, {"xs": ["a"]}, {"n": 0}, {"m": 1}, {"xs": ["k"], "z": None}],
    ),
    (  # open object below an array item and an anyOf; the parts' properties merged
        "nested-parts",
        {"type": "array", "items": {"type": "object", "allOf": [
            {"properties": {"tags": {"type": "array", "contains": {"type": "string"}}}},
            {"anyOf": [{"required": ["id"]}, {"properties": {"tags": {"maxItems": 2}}}]}]}},
        [[], [{"id": 1}], [{"tags": ["a"], "id": 0}, {"tags": [1, "b"]}], [{"other": [1]}]],
        [[1], [{"tags": [1]}], [{"tags": ["a", "b", "c"]}], [{"id": 1, "tags": []}]],
    ),
    (  # a required property no part lists takes additionalProperties' schema
        "required-unlisted",
        {"type": "object", "properties": {"a": {"contains": {"const": 2}}},
         "required": ["z"], "additionalProperties": {"type": "boolean"}},
        [{"z": True}, {"a": [2], "z": False}, {"a": "text", "z": True}],
        [{}, {"z": 1}, {"a": [1], "z": True}, {"a": [2]}],
    ),
    (  # references to a property and to a definition, copied beside the embeds that reach them
        "references",
        {"type": "object", "properties": {"kind": {"enum": ["x", "y"]},
                                          "xs": {"type": "array", "contains": {"$ref": "#/properties/kind"}},
                                          "d": {"$ref": "#/definitions/d"}},
         "definitions": {"d": {"type": "array", "items": {"$ref": "#/definitions/d"}}}},
        [{"kind": "x", "xs": ["y"]}, {"xs": [1, "x"], "d": [[], [[]]]}, {"d": []}],
        [{"xs": ["z"]}, {"kind": "z"}, {"d": [1]}, {"xs": []}],
    ),
]


def _texts(value, layout: str | None) -> list[str]:
    if layout == "compact":
        return [json.dumps(value, separators=(",", ":"))]
    if layout == "flexible":
        return [json.dumps(value), json.dumps(value, indent=2)]
    return [json.dumps(value)]


@pytest.mark.parametrize(("name", "schema", "valid", "invalid"), CASES + OBJECT_CASES,
                         ids=[c[0] for c in CASES + OBJECT_CASES])
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
    # an object written as a grammar (a property holds a contains): no unevaluatedProperties,
    # patterns that constrain values or names
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}},
      "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}},
      "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}},
      "propertyNames": {"maxLength": 3}}, "propertyNames"),
])
def test_unsupported_forms_are_refused_by_name(compiler, schema, keyword):
    with pytest.raises(UnsupportedConstraintError, match=repr(keyword)):
        compiler.compile(ConstraintSpec("json_schema", schema))


def test_unlisted_keys_exclude_every_spelling_of_the_listed_ones(compiler, tok):
    """``"\\u0061"`` is the key ``a``: as an unlisted key it would escape ``a``'s schema."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}},
              "additionalProperties": {"type": "array"}}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    grammar = compiled.inner  # the Lark grammar alone (served, keys take one spelling: canonical_keys)
    assert walk_text(grammar, tok, '{"\\u0061": [1]}')  # a listed key in any spelling
    assert not walk_text(compiled, tok, '{"\\u0061": [1]}')
    for matcher in (grammar, compiled):
        assert walk_text(matcher, tok, '{"a": [1], "b": []}')
        for text in ('{"\\u0061": [2]}', '{"a": [1], "\\u0061": []}', '{"a": [1], "\\u0041": 1}'):
            assert not walk_text(matcher, tok, text), text


@pytest.mark.parametrize("layout", ["compact", "flexible", "dumps"])
def test_object_grammar_follows_the_layout(compiler, tok, layout):
    schema = {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}, "b": {}},
              "required": ["a"]}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, {"json_layout": layout}))
    value = {"a": [0, 1], "b": {"k": [1, 2]}, "c": None}
    for text in _texts(value, layout):
        assert walk_text(compiled, tok, text), text
    assert not walk_text(compiled, tok, json.dumps({"a": [0], "b": 1}))
    if layout != "flexible":
        other = json.dumps(value) if layout == "compact" else json.dumps(value, separators=(",", ":"))
        assert not walk_text(compiled, tok, other)


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


@pytest.mark.parametrize("name", ["additional-schema", "required-unlisted"])
def test_random_objects_agree_with_jsonschema_and_mask(compiler, tok, name):
    """Random objects (listed and unlisted keys, random values): accepted iff jsonschema says
    valid, and the mask agrees with accept_token at every step."""
    import random

    from .test_mask_accept import _disagreements

    _, schema, valid, _ = next(c for c in OBJECT_CASES if c[0] == name)
    rng = random.Random(name)
    # the grammar's key order: listed, then required but unlisted, then the others
    order = list(dict.fromkeys([*schema["properties"], *schema.get("required", []), "a", "b", "c", "z", "é"]))
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    validator = jsonschema.validators.validator_for(schema)(schema)
    seen = {True: 0, False: 0}
    for _ in range(40):
        value = dict(rng.choice(valid))  # a valid object, one key set to a random value half the time
        if rng.random() < 0.5:
            value[rng.choice(order)] = rng.choice([[1], [2], [0, 2], 1, "x", True, None])
        value = {k: value[k] for k in order if k in value}  # listed keys first, as the grammar writes them
        text = json.dumps(value)
        assert walk_text(compiled, tok, text) == validator.is_valid(value), value
        assert not _disagreements(compiled.new_matcher(), tok.encode(text, add_special_tokens=False), rng), value
        seen[validator.is_valid(value)] += 1
    assert seen[False] > 0 and seen[True] > 0
