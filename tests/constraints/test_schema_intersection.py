"""Intersections written out before llguidance compiles (constraints/schema_intersection.py):
recursive schemas whose listed properties a catch-all ``patternProperties`` pattern also
matches (the shape of MaskBench's WashingtonPost ANS schemas) compile and classify exactly;
the rewrite keeps every schema's meaning, checked with jsonschema on both forms."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from constraints import ConstraintSpec
from constraints.schema_intersection import precompute_intersections

from .conftest import assert_classified, walk_json

DRAFT_04 = "http://json-schema.org/draft-04/schema#"

# a story holds related content keyed by any name; "redirect" is listed with its own schema,
# and the catch-all pattern (a pattern matches anywhere in a name) applies to it as well
STORY = {
    "$schema": DRAFT_04,
    "$ref": "#/definitions/story",
    "definitions": {
        "story": {
            "type": "object",
            "properties": {"type": {"enum": ["story"]}, "headline": {"type": "string"},
                           "related": {"$ref": "#/definitions/related"}},
            "required": ["type"],
            "additionalProperties": False,
        },
        "redirect": {
            "type": "object",
            "properties": {"type": {"enum": ["redirect"]}, "url": {"type": "string"}},
            "required": ["type", "url"],
            "additionalProperties": False,
        },
        "related": {
            "type": "object",
            "properties": {"redirect": {"type": "array", "maxItems": 1, "items": {"$ref": "#/definitions/redirect"}}},
            "patternProperties": {"^[a-z_]*": {
                "type": "array",
                "items": {"type": "object", "anyOf": [{"$ref": "#/definitions/story"}, {"$ref": "#/definitions/redirect"}]},
            }},
        },
    },
}
REDIRECT = {"type": "redirect", "url": "u"}
STORY_VALID = [
    {"type": "story"},
    {"type": "story", "related": {"redirect": [REDIRECT]}},
    {"type": "story", "related": {"more": [{"type": "story", "related": {"deeper": [REDIRECT]}}, REDIRECT]}},
    {"type": "story", "headline": "h", "related": {"redirect": [], "x": []}},
]
STORY_INVALID = [
    {"type": "story", "related": {"redirect": [REDIRECT, REDIRECT]}},  # the listed schema: maxItems
    {"type": "story", "related": {"redirect": [{"type": "story"}]}},  # listed items: redirects only
    {"type": "story", "related": {"more": [{"type": "other"}]}},  # the pattern's schema
    {"type": "story", "related": {"more": [{"type": "story", "related": {"x": [1]}}]}},
    {"type": "story", "related": {"x": 1}},
    {"type": "other"},
]


def test_recursive_listed_property_under_a_catch_all_pattern_compiles_and_classifies(compiler, tok):
    assert_classified(compiler, tok, STORY, STORY_VALID, STORY_INVALID)


def test_type_beside_anyof_of_recursive_refs_compiles(compiler, tok):
    node = {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "type": "object", "anyOf": [{"$ref": "#/$defs/node"}, {"$ref": "#/$defs/leaf"}]}}},
        "required": ["kids"], "additionalProperties": False}
    leaf = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"], "additionalProperties": False}
    schema = {"$ref": "#/$defs/node", "$defs": {"node": node, "leaf": leaf}}
    valid = [{"kids": []}, {"kids": [{"v": 1}, {"kids": [{"v": 2}]}]}]
    invalid = [{"kids": [1]}, {"kids": [{"v": "1"}]}, {}]
    assert_classified(compiler, tok, schema, valid, invalid)


# -- the rewrite itself: same instances, jsonschema on both forms ---------------------------------

SAME_MEANING = [
    (STORY, STORY_VALID + STORY_INVALID, True),
    # enums narrowed by the pattern's schema; a required property left with no value empties the object
    ({"type": "object", "properties": {"a": {"enum": ["x", 1, None]}, "b": {"type": "integer"}},
      "patternProperties": {".*": {"type": "string"}}},
     [{}, {"a": "x"}, {"a": 1}, {"a": None}, {"b": 1}, {"c": "s"}, {"c": 2}, {"a": "x", "c": "y"}], True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "patternProperties": {"^": {"type": "string"}}},
     [{}, {"a": 1}, {"a": "s"}, {"b": "s"}], False),
    # bounds, required and closed objects merged
    ({"type": "object",
      "properties": {"o": {"type": "object", "properties": {"p": {"type": "string", "minLength": 2}},
                           "required": ["p"], "additionalProperties": False}},
      "patternProperties": {"[^\\n]*": {"type": "object", "properties": {"p": {"maxLength": 3}, "q": {}},
                                        "required": ["q"]}}},
     [{"o": {"p": "ab"}}, {"o": {"p": "ab", "q": 1}}, {"o": {"p": "abcd", "q": 1}}, {"x": {"q": 1}}, {"x": {}}], True),
    # draft-04 exclusive bounds (a boolean beside its bound) and numeric ones (draft 6+)
    ({"$schema": DRAFT_04, "type": "object",
      "properties": {"n": {"type": "number", "minimum": 1, "exclusiveMinimum": True, "maximum": 9}},
      "patternProperties": {"": {"type": "number", "minimum": 1, "maximum": 5, "exclusiveMaximum": True}}},
     [{"n": 1}, {"n": 1.5}, {"n": 5}, {"n": 4.9}, {"n": 9}, {"m": 1}, {"m": 5}], True),
    ({"type": "object", "properties": {"n": {"exclusiveMinimum": 1, "maximum": 9}},
      "patternProperties": {"": {"minimum": 1, "exclusiveMaximum": 9}}},
     [{"n": 1}, {"n": 1.5}, {"n": 9}, {"n": 8}, {"m": 1}, {"m": 9}], True),
    # a listed object merged with the pattern's object, patterns on one side
    ({"type": "object", "properties": {"o": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                             "additionalProperties": {"type": "string"}}},
      "patternProperties": {"^[^\\n]*": {"type": "object", "properties": {"xa": {"minimum": 3}, "b": {"maxLength": 1}}}}},
     [{"o": {"xa": 3}}, {"o": {"xa": 2}}, {"o": {"xa": "s"}}, {"o": {"b": "s"}}, {"o": {"b": "st"}},
      {"o": {"b": 1}}, {"o": {"xz": 1, "c": "s"}}, {"o": {"c": 1}}, {"p": {"xa": 1}}], True),
]


@pytest.mark.parametrize(("schema", "instances", "rewritten"), SAME_MEANING,
                         ids=["story", "enum", "required-and-empty", "merged", "draft-04-bounds", "bounds",
                              "patterns"])
def test_the_rewrite_keeps_every_instance_s_verdict(schema, instances, rewritten):
    original = copy.deepcopy(schema)
    result = precompute_intersections(schema)
    assert schema == original  # the input is not modified
    # the catch-all pattern no longer covers the listed names (unless a required one is left
    # with no value: then the object is left as written)
    assert (result != schema) == rewritten
    rewritten = result
    cls = jsonschema.validators.validator_for(schema)
    for value in instances:
        assert cls(rewritten).is_valid(value) == cls(schema).is_valid(value), value


def test_the_narrowed_pattern_leaves_out_exactly_the_listed_names():
    schema = {"type": "object", "properties": {"ab": {}, "b": {}}, "patternProperties": {"^[^\\n]*": {"type": "null"}}}
    (pattern,) = precompute_intersections(schema)["patternProperties"]
    import re

    for name in ["", "a", "abc", "ba", "bb", "x", "a\nb", "A"]:
        assert re.search(pattern, name)
    for name in ["ab", "b"]:
        assert not re.search(pattern, name)


@pytest.mark.parametrize("schema", [
    # a pattern that does not match every name: the backends intersect as before
    {"properties": {"a": {"type": "string"}}, "patternProperties": {"^a$": {"maxLength": 2}}},
    # two patterns different in a way no one pattern says: left alone
    {"properties": {"a": {"type": "string", "pattern": "x"}}, "patternProperties": {".*": {"type": "string", "pattern": "y"}}},
    # "." stops at a line break: "^.*$" does not match every name
    {"properties": {"a": {"type": "string"}}, "patternProperties": {"^.*$": {"minLength": 1}}},
    # a reference into the object's properties would see the merged schema
    {"properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}, "patternProperties": {".*": {"minLength": 1}}},
])
def test_objects_without_an_exact_rewrite_are_left_as_written(schema):
    assert precompute_intersections(schema) == schema


def test_the_catch_all_still_applies_to_unlisted_names(compiler, tok):
    schema = {"type": "object", "properties": {"id": {"type": "integer"}},
              "patternProperties": {".*": {"type": ["integer", "string"]}}, "additionalProperties": False}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(compiled, tok, {"id": 1, "name": "n"})
    assert not walk_json(compiled, tok, {"id": "1"})
    assert not walk_json(compiled, tok, {"name": None})
