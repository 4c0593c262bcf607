"""``propertyNames`` beside ``patternProperties`` (constraints/schema/named_patterns.py, through
the coverage rewrite): the rewrite keeps no ``propertyNames`` and accepts the same objects."""

from __future__ import annotations

import jsonschema
import pytest

from constraints.schema.analysis import rewrite_schema
from constraints.schema.tree import subschemas

# MaskBench JsonSchemaStore golangci-lint (listed names, an open object) and Github_hard
# o12459 (listed names, a closed object whose one pattern takes every key)
LISTED_OPEN = {"type": "object", "propertyNames": {"enum": ["atomic", "bools", "x1"]},
               "properties": {"bools": {"type": "boolean"}},
               "patternProperties": {"^[a-z]+$": {"type": "object"}}}
LISTED_CLOSED = {"type": "object", "propertyNames": {"$ref": "#/$defs/name"}, "additionalProperties": False,
                 "patternProperties": {".+": {"type": "number"}},
                 "$defs": {"name": {"type": "string", "enum": ["p10", "p300"]}}}
# a lone name pattern on a closed object (MaskBench JsonSchemaStore conjure.schema)
PATTERN_CLOSED = {"type": "object", "propertyNames": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                  "additionalProperties": False, "properties": {"Ab": {"type": "string"}, "ab": {"type": "string"}},
                  "patternProperties": {"": {"type": "integer"}, "^x": {"minimum": 3}}}
# a lone name pattern on an open object (MaskBench Github_hard o83677)
PATTERN_OPEN = {"type": "object", "propertyNames": {"pattern": "^_?[a-z]+$"},
                "patternProperties": {"^[a-z]+$": {"type": "number"}}}
# names of a union, the non-string branch dropping out (MaskBench Github_hard o67457)
UNION_CLOSED = {"type": "object", "additionalProperties": False, "propertyNames": {"$ref": "#/$defs/id"},
                "patternProperties": {".+": {"type": "string"}},
                "$defs": {"id": {"allOf": [{"oneOf": [{"type": "number", "minimum": 1},
                                                      {"type": "string", "pattern": "^[1-9][0-9]*$"},
                                                      {"$ref": "#/$defs/wild"}]}]},
                          "wild": {"type": "string", "pattern": "^Q$"}}}
VALUES = [{}, {"atomic": {}}, {"atomic": 1}, {"bools": True}, {"bools": {}}, {"x1": 2}, {"x1": {}}, {"other": {}},
          {"p10": 1}, {"p10": "a"}, {"p300": 2, "p10": 3}, {"p50": 1}, {"Ab": "s"}, {"Ab": 1}, {"ab": "s"},
          {"Cd": 4}, {"Cd": "4"}, {"xy": 5}, {"Xy": 1}, {"Q": 1}, {"_a": "s"}, {"a": "s"}, {"a_": 1},
          {"12": "s"}, {"12": 1}, {"012": "s"}, {"Q": "s"}, {"QQ": "s"}]


@pytest.mark.parametrize("schema", [LISTED_OPEN, LISTED_CLOSED, PATTERN_CLOSED, PATTERN_OPEN, UNION_CLOSED])
def test_property_names_beside_patterns_are_folded_in(schema):
    out = rewrite_schema(schema)
    assert not any(isinstance(n, dict) and "propertyNames" in n for _, n in subschemas(out))
    check, got = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(out)
    for value in VALUES:
        assert got.is_valid(value) == check.is_valid(value), value


def test_a_name_pattern_beside_listed_properties_and_additional_properties_stays():
    # the additionalProperties pattern would take the listed names too
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "patternProperties": {"^a": {}},
              "properties": {"b": {}}, "additionalProperties": {"type": "string"}}
    assert "propertyNames" in rewrite_schema(schema)


def test_listed_names_are_enforced(compiler, tok):
    from .conftest import assert_classified

    assert_classified(compiler, tok, LISTED_CLOSED, valid=[{}, {"p10": 1}, {"p300": 2.5, "p10": 3}],
                      invalid=[{"p50": 1}, {"p10": "a"}, {"": 1}])
