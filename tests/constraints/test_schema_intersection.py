"""Intersections written out before llguidance compiles (constraints/schema/intersection.py):
recursive schemas whose listed properties a catch-all ``patternProperties`` pattern also
matches (the shape of MaskBench's WashingtonPost ANS schemas) compile and classify exactly;
the rewrite keeps every schema's meaning, checked with jsonschema on both forms."""

from __future__ import annotations

import copy
import random
from typing import Any

import jsonschema
import pytest

from constraints import ConstraintSpec
from constraints.schema.intersection import precompute_intersections

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
    # both sides' required members
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"p": {}}, "required": ["p"]}},
      "patternProperties": {"^": {"type": "object", "required": ["q"]}}},
     [{"o": {"p": 1}}, {"o": {"q": 1}}, {"o": {"p": 1, "q": 2}}, {"r": {"p": 1}}, {"r": {"q": 1}}], True),
    # draft-04 exclusive bounds (a boolean beside its bound) and numeric ones (draft 6+)
    ({"$schema": DRAFT_04, "type": "object",
      "properties": {"n": {"type": "number", "minimum": 1, "exclusiveMinimum": True, "maximum": 9}},
      "patternProperties": {"^": {"type": "number", "minimum": 1, "maximum": 5, "exclusiveMaximum": True}}},
     [{"n": 1}, {"n": 1.5}, {"n": 5}, {"n": 4.9}, {"n": 9}, {"m": 1}, {"m": 5}], True),
    ({"type": "object", "properties": {"n": {"exclusiveMinimum": 1, "maximum": 9}},
      "patternProperties": {"^": {"minimum": 1, "exclusiveMaximum": 9}}},
     [{"n": 1}, {"n": 1.5}, {"n": 9}, {"n": 8}, {"m": 1}, {"m": 9}], True),
    # a listed object merged with the pattern's object, patterns on one side
    ({"type": "object", "properties": {"o": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                             "additionalProperties": {"type": "string"}}},
      "patternProperties": {"^[^\\n]*": {"type": "object", "properties": {"xa": {"minimum": 3}, "b": {"maxLength": 1}}}}},
     [{"o": {"xa": 3}}, {"o": {"xa": 2}}, {"o": {"xa": "s"}}, {"o": {"b": "s"}}, {"o": {"b": "st"}},
      {"o": {"b": 1}}, {"o": {"xz": 1, "c": "s"}}, {"o": {"c": 1}}, {"p": {"xa": 1}}], True),
]


@pytest.mark.parametrize(("schema", "instances", "rewritten"), SAME_MEANING,
                         ids=["story", "enum", "required-and-empty", "merged", "required", "draft-04-bounds", "bounds",
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


# -- random schemas: the rewrite never changes a verdict ---------------------------------------------

def _random_subschema(rng: random.Random, depth: int) -> dict:
    kind = rng.randrange(9)
    if kind == 0:
        return {"type": rng.choice(["string", "integer", "number", "boolean", "null"])}
    if kind == 1:
        return {"type": "string", "minLength": rng.randrange(4), "maxLength": rng.randrange(1, 5)}
    if kind == 2:
        return {"enum": rng.sample(["a", "b", "", 1, 2, None, True, {"x": 1}, [1]], rng.randrange(1, 4))}
    if kind == 3:
        return {"type": "number", "minimum": rng.randrange(-2, 3), "exclusiveMaximum": rng.randrange(3, 6)}
    if kind == 4:
        return {"$ref": "#/$defs/node"}
    if depth >= 2:
        return {"type": "integer"}
    if kind == 5:
        return {"type": "array", "items": _random_subschema(rng, depth + 1), "maxItems": rng.randrange(1, 4)}
    if kind == 6:
        return _random_object(rng, depth + 1)
    if kind == 7:
        return {"anyOf": [_random_subschema(rng, depth + 1), _random_subschema(rng, depth + 1)]}
    return {"allOf": [_random_subschema(rng, depth + 1)]}


def _random_object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["a", "b", "c"], rng.randrange(1, 3))
    node: dict = {"type": "object", "properties": {n: _random_subschema(rng, depth + 1) for n in names}}
    if rng.random() < 0.5:
        node["required"] = [names[0]]
    if rng.random() < 0.4:
        node["additionalProperties"] = rng.choice([False, {"type": "string"}])
    return node


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind < 6:
        return [None, True, rng.choice([0, 1, 3, 4.5, -1, 5]), rng.choice(["", "a", "ab", "abc", "abcd"]),
                rng.choice(["a\nb", "x"]), 2][kind]
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["a", "b", "c", "d", "x", "\n"]): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_random_schemas_keep_every_verdict():
    """Random objects under a catch-all pattern (with recursion through $defs): jsonschema gives
    every random instance the same verdict on the rewritten schema as on the original. ("" as
    the pattern is left out: jsonschema then takes every member as additional.)"""
    rng = random.Random(0)
    rewritten_count = 0
    for _ in range(600):
        schema = _random_object(rng, 0)
        schema["patternProperties"] = {rng.choice(["^", "^[a-z]*", "[^\\n]*", "(?:)"]): _random_subschema(rng, 1)}
        if rng.random() < 0.3:
            schema["patternProperties"]["^x"] = {"type": "integer"}
        schema["$defs"] = {"node": {"type": ["object", "string"], "properties": {"a": {"$ref": "#/$defs/node"}},
                                    "maxLength": 2}}
        rewritten = precompute_intersections(schema)
        rewritten_count += rewritten != schema
        before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
        for _ in range(60):
            value = {name: _random_value(rng, 1) for name in rng.sample(["a", "b", "c", "x", "y"], rng.randrange(4))}
            assert after.is_valid(value) == before.is_valid(value), (schema, rewritten, value)
    assert rewritten_count > 300  # most objects were rewritten, so the check means something


# a geometry whose collection holds geometries ("#"), with keywords beside the oneOf: llguidance
# refused it ("circular references with sibling keys"), the distributed form compiles
GEOMETRY = {
    "$schema": DRAFT_04, "type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
    "oneOf": [{"$ref": "#/definitions/collection"}, {"$ref": "#/definitions/point"}],
    "definitions": {
        "collection": {"required": ["geometries"], "properties": {
            "type": {"enum": ["GeometryCollection"]}, "geometries": {"type": "array", "items": {"$ref": "#"}}}},
        "point": {"required": ["coordinates"], "properties": {
            "type": {"enum": ["Point"]}, "coordinates": {"type": "array", "items": {"type": "number"}}}},
    },
}


def test_a_recursion_into_keywords_beside_oneof_compiles_and_classifies(compiler, tok):
    point = {"type": "Point", "coordinates": [1, 2]}
    valid = [point, {"type": "GeometryCollection", "geometries": [point, {"type": "GeometryCollection", "geometries": []}]}]
    invalid = [{"type": "Point"}, {"type": "GeometryCollection", "geometries": [{"type": "Point"}]},
               {"type": 3, "coordinates": []}, {"coordinates": [1]}]
    assert_classified(compiler, tok, GEOMETRY, valid, invalid)


def test_distributed_siblings_keep_every_verdict():
    from constraints.schema.intersection import distribute_siblings

    schema = {k: v for k, v in GEOMETRY.items() if k != "oneOf"} | {"anyOf": GEOMETRY["oneOf"]}
    distributed = distribute_siblings(schema)
    assert distributed is not None and not {"type", "required", "properties"} & set(distributed)
    rng = random.Random(3)
    for _ in range(200):
        kind = rng.choice(["Point", "GeometryCollection", "Other", 3])
        value = {"type": kind, **({"coordinates": [rng.random()]} if rng.random() < 0.6 else {}),
                 **({"geometries": [{"type": "Point", "coordinates": []}] * rng.randint(0, 2)} if rng.random() < 0.6 else {})}
        verdicts = [jsonschema.Draft4Validator(s).is_valid(value) for s in (schema, distributed)]
        assert verdicts[0] == verdicts[1], value
