"""Small objects accept their properties in any order (constraints/schema/property_order.py): every
order of a valid object is accepted token by token, invalid objects are still refused in every
order (each property once, required ones present, each value's schema), checked against
jsonschema; objects beyond the size or budget are not spelled out."""

from __future__ import annotations

import itertools

import jsonschema
import pytest

from constraints import ConstraintSpec
from constraints.schema.property_order import MAX_BRANCHES, MAX_PROPERTIES, any_order

from .conftest import walk_json, walk_text

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "minimum": 0}, "label": {"type": "string"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


def _orders(value: dict, schema: dict | None = None) -> list[dict]:
    """``value`` in every order of its listed properties; members the schema does not list
    stay after them (the backends take extra members after the listed ones)."""
    listed = [k for k in value if schema is None or k in schema.get("properties", {})]
    extra = [k for k in value if k not in listed]
    return [{k: value[k] for k in (*keys, *extra)} for keys in itertools.permutations(listed)]


CASES = [
    (POINT, [{"x": 1, "y": 2}, {"x": -1, "y": 0, "label": "a"}],
     [{"x": 1}, {"x": 1, "y": -1}, {"x": 1, "y": 2, "z": 3}, {"x": "1", "y": 2}, {"x": 1, "y": 2, "label": 3}]),
    # nested: the inner object is rewritten too, its values shared through $defs
    ({"type": "object", "properties": {"p": POINT, "n": {"type": "null"}}, "required": ["p"]},
     [{"p": {"x": 1, "y": 2}, "n": None}, {"p": {"y": 0, "label": "", "x": 5}}],
     [{"n": None}, {"p": {"x": 1}, "n": None}, {"p": {"x": 1, "y": 2}, "n": 0}]),
    # open objects: extra members still follow the schema of additionalProperties / patternProperties
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}},
      "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": {"type": "null"}},
     [{"a": "s", "b": True}, {"b": False, "a": "", "x-1": 3}, {"b": True, "other": None}],
     [{"b": "s", "a": "t"}, {"a": "s", "x-1": "no"}, {"b": True, "other": 1}]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES, ids=["closed", "nested", "open"])
def test_any_property_order_is_accepted_and_nothing_else(compiler, tok, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in valid:
        for ordered in _orders(value, schema):
            jsonschema.validate(ordered, schema)
            assert walk_json(compiled, tok, ordered), ordered
    for value in invalid:
        for ordered in _orders(value):
            assert not jsonschema.Draft202012Validator(schema).is_valid(ordered)
            assert not walk_json(compiled, tok, ordered), ordered


def test_a_property_is_taken_once(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", POINT))
    assert walk_text(compiled, tok, '{"y": 1, "x": 2}')
    assert not walk_text(compiled, tok, '{"y": 1, "x": 2, "y": 3}')
    assert not walk_text(compiled, tok, '{"x": 1, "x": 2, "y": 3}')


def test_larger_objects_are_not_spelled_out():
    """Their order is freed by run-time checks instead (tests/constraints/test_free_order.py)."""
    names = [f"p{i}" for i in range(MAX_PROPERTIES + 1)]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}
    assert any_order(schema) == schema


def test_the_budget_goes_to_outer_objects_first():
    inner = {"type": "object", "properties": {c: {"type": "integer"} for c in "abcd"}}
    schema = {"type": "object", "properties": {f"k{i}": inner for i in range(MAX_BRANCHES // 24 + 2)}}
    out = any_order(schema)
    assert "anyOf" not in out  # the outer object is over MAX_PROPERTIES
    rewritten = [name for name, sub in out["properties"].items() if "anyOf" in sub]
    assert rewritten == [f"k{i}" for i in range(MAX_BRANCHES // 24)]  # first come, until the budget


def test_references_into_a_node_keep_it_in_place():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}
    assert any_order(schema) == schema
    # a new base URI below the root: moving values could change what their references mean
    scoped = {"type": "object", "properties": {"a": {"$id": "http://x/a", "type": "integer"}, "b": {}}}
    assert any_order(scoped) == scoped


def test_rewrite_keeps_the_meaning():
    """The rewritten schema is itself a JSON schema with the same instances (jsonschema)."""
    schema = CASES[1][0]
    out = any_order(schema)
    for value in [*CASES[1][1], *CASES[1][2], {"p": {"x": 1, "y": 1}}, 3, "s"]:
        for ordered in _orders(value) if isinstance(value, dict) else [value]:
            assert jsonschema.Draft202012Validator(out).is_valid(ordered) == \
                jsonschema.Draft202012Validator(schema).is_valid(ordered)


def test_one_of_and_all_of_branches_keep_their_form(compiler, tok):
    """llguidance proves oneOf branches exclusive from their properties (MaskBench Github_medium
    o25768): branches reached through $ref are not turned into anyOf copies."""
    file_ = {"type": "object", "properties": {"kind": {"const": "file"}, "size": {"type": "integer"}},
             "required": ["kind"], "additionalProperties": False}
    link = {"type": "object", "properties": {"kind": {"const": "link"}, "to": {"type": "string"}},
            "required": ["kind"], "additionalProperties": False}
    schema = {"definitions": {"file": file_, "link": link},
              "oneOf": [{"$ref": "#/definitions/file"}, {"$ref": "#/definitions/link"}]}
    assert any_order(schema) == schema
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(compiled, tok, {"kind": "file", "size": 3})
    assert not walk_json(compiled, tok, {"kind": "file", "to": "x"})
    merged = {"definitions": {"file": file_}, "allOf": [{"$ref": "#/definitions/file"}, {"required": ["size"]}]}
    assert any_order(merged) == merged


def test_a_refusal_names_the_location_the_client_wrote(compiler):
    from constraints import UnsupportedConstraintError

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {}, "y": {}}, "propertyNames": {"maxLength": 1, "pattern": "^x"}},
        "b": {"type": "integer"}}}
    with pytest.raises(UnsupportedConstraintError) as err:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert err.value.pointer == "/properties/a" and "trellis-order" not in str(err.value)


def test_forbidden_properties_stay_false_in_place():
    out = any_order({"type": "object", "properties": {"id": {"type": "integer"}, "ID": False}})
    assert all(copy["properties"]["ID"] is False for copy in out["anyOf"])


def test_values_beside_pattern_properties_keep_their_form():
    """A name matching a pattern is checked against both values: llguidance intersects them,
    so neither side becomes anyOf copies (MaskBench WashingtonPost wp_68)."""
    label = {"type": "object", "properties": {c: {"type": "string"} for c in "abc"}, "additionalProperties": False}
    schema = {"type": "object", "properties": {"basic": label}, "patternProperties": {"^[a-z]*$": label},
              "additionalProperties": False}
    assert any_order(schema) == schema


def test_the_declared_order_is_tried_when_the_spelled_out_orders_fail():
    """Every order spelled out can be too large for llguidance ("schema too large": MaskBench
    JsonSchemaStore jreleaser-1.7.0) where the declared one compiles: it comes next, before
    xgrammar, with the same rewrite otherwise."""
    from constraints.compile.planner import plan

    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    attempts = plan(ConstraintSpec("json_schema", schema))
    first, second = attempts[0], attempts[1]
    assert (first.backend, second.backend) == ("llguidance", "llguidance")
    assert "anyOf" in first.source and second.source["properties"] == schema["properties"]
    declared = plan(ConstraintSpec("json_schema", schema, {"json_property_order": "declared"}))
    assert [a.backend for a in declared] == ["llguidance", "xgrammar"]


def test_keys_no_draft_defines_are_left_out_of_the_copies(compiler, tok):
    """An editor's hint beside the properties (MaskBench JsonSchemaStore cargo-make's
    ``x-taplo``, Snowplow's ``self``) asserts nothing: the object still takes any order."""
    schema = {"type": "object", "x-taplo": {"initKeys": ["b"]}, "self": {"vendor": "v"},
              "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    out = any_order(schema)
    assert len(out["anyOf"]) == 2 and not any("x-taplo" in c or "self" in c for c in out["anyOf"])
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(compiled, tok, {"b": "x", "a": 1}) and walk_json(compiled, tok, {"a": 1})
    assert not walk_json(compiled, tok, {"b": "x"}) and not walk_json(compiled, tok, {"a": "x"})


def test_a_reference_into_an_unknown_key_keeps_the_node_in_place():
    schema = {"type": "object", "meta": {"type": "string"},
              "properties": {"a": {"$ref": "#/meta"}, "b": {"type": "integer"}}}
    assert any_order(schema) == schema
