"""Valid MaskBench instances Trellis once rejected, reduced to small schemas: each instance is
walked token by token and its validity is checked against jsonschema as well."""

from __future__ import annotations

import jsonschema
import pytest

from constraints import ConstraintSpec
from constraints.schema.analysis import normalise_schema, rewrite_schema

from .conftest import assert_classified, walk_json

DRAFT_04 = "http://json-schema.org/draft-04/schema#"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"

# oneOf placed before properties: llguidance writes the branches' properties first
ONE_OF_FIRST = {
    "type": "object",
    "oneOf": [
        {"properties": {"config": {"enum": ["left"]}}, "required": ["config"]},
        {"properties": {"config": {"enum": ["right"]}}, "required": ["config"]},
    ],
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
}


def _ref_with_sibling(draft: str | None) -> dict:
    schema = {
        "properties": {"s": {"$ref": "#/definitions/o", "required": ["w"]}},
        "required": ["s"],
        "definitions": {"o": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}},
    }
    return {"$schema": draft, **schema} if draft else schema


CASES = [
    # MaskBench Github_medium o85188: the oneOf -> anyOf rewrite moved "config" behind "content"
    (ONE_OF_FIRST, [{"config": "left", "content": "x"}, {"config": "right", "content": ""}],
     [{"config": "up", "content": "x"}, {"content": "x"}]),
    # MaskBench Github_medium o14421: drafts 4 to 7 ignore the keywords beside "$ref"
    ({"$schema": DRAFT_04, "type": "object",
      "properties": {"Sensor": {"type": "string", "$ref": "#/datos"}},
      "datos": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}},
     [{"Sensor": {"v": 1}}], [{"Sensor": "x"}, {"Sensor": {"v": "1"}}]),
    (_ref_with_sibling(DRAFT_07), [{"s": {"v": 1}}, {"s": {"v": 1, "w": 2}}], [{"s": {"w": 2}}, {"s": 1}]),
    # ... while from 2019-09 on (and with no $schema: the latest draft) they apply
    (_ref_with_sibling(None), [{"s": {"v": 1, "w": 2}}], [{"s": {"v": 1}}, {"s": {"w": 2}}]),
    # MaskBench Github_trivial o51159: a oneOf discriminated on objects, written without "type"
    # (a non-object matches both branches, so it matches no oneOf)
    ({"properties": {"card": {"oneOf": [
        {"additionalProperties": False, "properties": {"provider": {"enum": ["mastercard"]}},
         "required": ["provider"]},
        {"additionalProperties": False, "properties": {"provider": {"enum": ["visa"]}, "code": {"type": "integer"}},
         "required": ["provider", "code"]}]}}},
     [{"card": {"provider": "mastercard"}}, {"card": {"provider": "visa", "code": 1}}, {}],
     [{"card": "visa"}, {"card": 1}, {"card": {"provider": "visa"}}, {"card": {"provider": "amex"}}]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES, ids=range(len(CASES)))
def test_instances_are_classified_as_jsonschema_does(compiler, tok, schema, valid, invalid):
    assert_classified(compiler, tok, schema, valid, invalid)


@pytest.mark.parametrize(
    ("schema", "replaced"),
    [
        (ONE_OF_FIRST, "oneOf"),
        ({"not": {"required": ["b"]}, "properties": {"a": {}, "b": {}}}, "not"),
        ({"if": {"required": ["a"]}, "then": {"required": ["b"]}, "properties": {"a": {}, "b": {}}}, "if"),
        ({"properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}, "type": "object"}, "dependencies"),
        ({"properties": {"a": {}}, "allOf": [{"required": ["a"]}], "type": "object",
          "oneOf": [{"required": ["b"]}, {"required": ["c"], "properties": {"b": False}}]}, "allOf"),
    ],
)
def test_a_rewrite_keeps_the_place_of_the_keyword_it_replaces(schema, replaced):
    """llguidance orders an object's properties by where each keyword sits in the schema."""
    rewritten = rewrite_schema(normalise_schema(schema))
    original, keys = list(schema), list(rewritten)
    assert "allOf" in keys and keys.index("allOf") == original.index(replaced)
    assert [k for k in keys if k != "allOf"] == [k for k in original if k in keys and k != "allOf"]


# MaskBench Github_medium o62823: dependencies written before properties (draft-04)
DEPENDENCIES_FIRST = {
    "$schema": DRAFT_04,
    "type": "object",
    "dependencies": {"url": {"properties": {"media": {"type": "string", "pattern": "^[a-z]+/[a-z]+$"}},
                             "required": ["media"]}},
    "properties": {"kind": {"enum": ["dist"]}, "url": {"type": "string"}, "media": {"type": "string"},
                   "title": {"type": "string"}, "format": {"type": "string"}},
}


def test_dependencies_keep_the_declared_property_order(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", DEPENDENCIES_FIRST))
    valid = [{"kind": "dist", "url": "u", "media": "text/csv", "title": "t"}, {"kind": "dist", "title": "t"}]
    invalid = [{"kind": "dist", "url": "u", "title": "t"}, {"kind": "dist", "url": "u", "media": "csv"}]
    validator = jsonschema.Draft4Validator(DEPENDENCIES_FIRST)
    for value in valid:
        assert validator.is_valid(value) and walk_json(compiled, tok, value), value
    for value in invalid:
        assert not validator.is_valid(value) and not walk_json(compiled, tok, value), value
