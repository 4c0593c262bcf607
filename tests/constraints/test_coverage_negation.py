"""Negations with an exact enforceable form (constraints/schema/negation.py ``negate``) and
finite regex languages (constraints/regex/analysis.py ``finite_strings``): valid instances are
accepted token by token (mask and accept), invalid ones rejected, checked against jsonschema."""

from __future__ import annotations

import jsonschema
import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.regex.analysis import finite_strings
from constraints.regex.dialect import ecma_regex

from .conftest import walk_json

CASES = [
    (  # some property is named "0"
        {"type": "object", "not": {"propertyNames": {"not": {"const": "0"}}},
         "patternProperties": {"^[0-9]$": {"type": "boolean"}}, "additionalProperties": False},
        [{"0": True}, {"0": True, "1": False}],
        [{}, {"1": True}, {"0": 1}],
    ),
    (  # at least one property
        {"type": "object", "not": {"propertyNames": False}},
        [{"a": 1}, {"b": None}],
        [{}],
    ),
    (  # not every one-digit key is outside {1, 3}: "1" or "3" is present
        {"type": "object", "patternProperties": {"^[0-9]$": {"type": "integer"}}, "additionalProperties": False,
         "not": {"patternProperties": {"^(1|3)$": False}}, "maxProperties": 2},
        [{"1": 5}, {"3": 1, "7": 2}],
        [{}, {"2": 1}, {"1": 1, "2": 2, "3": 3}, {"x": 1}],
    ),
    (  # some key in {"a", "b"} holds a string
        {"type": "object", "not": {"patternProperties": {"^(a|b)$": {"not": {"type": "string"}}}}},
        [{"a": "x"}, {"b": "y", "c": 1}],
        [{}, {"a": 1}, {"c": "x"}],
    ),
    (  # no item is a string: every item is not
        {"type": "array", "not": {"contains": {"type": "string"}}},
        [[], [1, 1.5], [None]],
        [["a"], [1, "b"]],
    ),
    (  # the negated schema sits under a key that is no schema keyword
        {"type": "object", "allOf": [{"$ref": "#/my/npn"}], "my": {"npn": {"not": {"propertyNames": {"not": {"const": "k"}}}}}},
        [{"k": 1}],
        [{}, {"j": 1}],
    ),
]


CASES += [
    (  # bounded multiples, with what the backends skip beside them
        {"type": "integer", "multipleOf": 13, "exclusiveMinimum": 100, "exclusiveMaximum": 300,
         "not": {"anyOf": [{"multipleOf": 2}, {"multipleOf": 3}]}},
        [143, 169, 221, 299],
        [130, 156, 104, 13, 286, 312],
    ),
    (  # oneOf over listed values, non-disjoint, filtered by the whole schema
        {"type": "array", "oneOf": [{"$ref": "#/definitions/x"}, {"$ref": "#/definitions/y"}],
         "definitions": {"x": {"enum": [[1], [1, 2], [5]]}, "y": {"enum": [[1], [3]]}}},
        [[1, 2], [5], [3]],
        [[1], [2], []],
    ),
    (  # not of a schema with a keyword no draft defines (an annotation) and a property count
        {"type": "object", "not": {"minProperties": 1, "x-note": "anything"}},
        [{}],
        [{"a": 1}],
    ),
    (  # not a pattern: the strings it matches nowhere (a complement DFA written back as a regex)
        {"type": "string", "not": {"pattern": "^[.,*\\s-]+$"}},
        ["a", "", "a.", ". b", "x y"],
        ["...", "- -", " "],
    ),
    (  # oneOf over patterns a string can match together: exactly one of them
        {"type": "string", "oneOf": [{"pattern": "cat"}, {"pattern": "dog"}, {"pattern": "^[a-z]{3}$"}]},
        ["a cat", "dogs", "cow", "hotdog!"],
        ["catdog", "cat", "dog", "owl!", "", "dog cat"],
    ),
    (  # not listed integers: the open intervals between them (MaskBench Github_hard o57622)
        {"type": "integer", "not": {"enum": [6379, 6380, 43215]}},
        [0, 6378, 6381, 43216, -5, 43214],
        [6379, 6380, 43215, 6379.0, 6379.5, "6379"],
    ),
    (  # the same in draft 4 (exclusive bounds as booleans there), numbers beside other literals
        {"$schema": "http://json-schema.org/draft-04/schema#", "not": {"enum": [1, 2.0, "a", None]}},
        [0, 1.5, 3, -1, 2.5, "b", True, [], {}],
        [1, 2, 2.0, 1.0, "a", None],
    ),
    (  # not items = contains the negation, in an object property: the object written as a grammar
        # (tests/constraints/test_schema_lark.py); non-arrays satisfy items, so they fail here
        {"type": "object", "properties": {"a": {"not": {"items": {"type": "string"}}}}},
        [{}, {"a": [1]}, {"a": ["x", 2]}, {"a": [{}]}],
        [{"a": 1}, {"a": []}, {"a": ["x"]}, {"a": "s", "b": []}],
    ),
    (  # the same in draft 4, where "contains" is no keyword: the grammar counts it, not llguidance's
        # JSON compiler (which would skip it)
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
         "properties": {"a": {"not": {"type": "array", "items": {"type": "string"}}}}},
        [{}, {"a": 1}, {"a": [1]}, {"a": ["x", None]}, {"a": "s", "b": []}],
        [{"a": []}, {"a": ["x"]}, {"a": ["x", "y"]}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES,
                         ids=["name-const", "name-false", "pattern-false", "pattern-value", "contains",
                              "unlisted-ref", "bounded-multiples", "oneof-listed", "unknown-keyword",
                              "not-pattern", "oneof-patterns", "not-integers", "not-numbers-draft4",
                              "not-items-in-property", "not-items-in-property-draft4"])
def test_negated_keyword_is_enforced_exactly(compiler, tok, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in valid:
        jsonschema.validate(value, schema)
        assert walk_json(compiled, tok, value), value
    for value in invalid:
        assert not jsonschema.Draft202012Validator(schema).is_valid(value), value
        assert not walk_json(compiled, tok, value), value


@pytest.mark.parametrize("schema", [
    {"type": "object", "not": {"propertyNames": {"not": {"pattern": "a"}}}},  # unbounded names
    {"type": "object", "not": {"patternProperties": {"a": {"type": "string"}}}},
    {"type": "number", "not": {"const": 0.5}},  # a fractional value: no exact bound for every backend
])
def test_negations_without_an_exact_form_are_refused(compiler, schema):
    with pytest.raises(UnsupportedConstraintError, match="'not'|'contains'"):
        compiler.compile(ConstraintSpec("json_schema", schema))


@pytest.mark.parametrize(("pattern", "strings"), [
    ("^(1|3|4)$", ["1", "3", "4"]),
    (r"^\d$", [str(d) for d in range(10)]),
    ("^a?b{0,2}$", ["", "a", "ab", "abb", "b", "bb"]),
    ("a", None),  # unanchored: infinite
    ("^.{1,3}$", None),  # too many
    ("^[^a]$", None),
    ("(?i)^a$", None),
    ("^(?i:a)$", None),
    ("^a+$", None),
])
def test_finite_strings(pattern, strings):
    assert finite_strings(ecma_regex(pattern)) == strings


# a $ref into a subschema the rewrite replaces (a double "not", an "if"/"then") still reaches it:
# the target is copied to $defs first (MaskBench Synthesized draft2019_09_nonvalid_ref_id1)
REF_INTO_REWRITTEN = [
    ({"allOf": [{"enum": [{"foo": False}, {"foo": {"foo": {}}}, {"foo": 1}]},
                {"not": {"not": {"additionalProperties": False, "properties": {"foo": {"$ref": "#/allOf/1/not/not"}}}}}]},
     [{"foo": False}, {"foo": {"foo": {}}}, {"foo": 1}], [{"foo": False, "bar": True}, {}, {"foo": {"x": 1}}]),
    ({"type": "object", "properties": {"a": {"$ref": "#/then/properties/b"}},
      "if": {"required": ["a"]}, "then": {"properties": {"b": {"type": "integer", "minimum": 2}}}},
     [{"a": 2}, {"a": 3, "b": 9}, {}], [{"a": 1}, {"a": "x"}, {"a": 2, "b": 1}]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), REF_INTO_REWRITTEN, ids=["double-not", "then"])
def test_references_into_rewritten_keywords_still_resolve(compiler, tok, schema, valid, invalid):
    from .conftest import assert_classified

    assert_classified(compiler, tok, schema, valid, invalid)


# a recursive schema has no finite negation: negate says so (None) instead of following the
# $ref cycle until the stack runs out, which dropped every rewrite of the schema, a disjoint
# oneOf's among them (MaskBench Github_hard o91595, o71454, o76745, Github_medium o79474)
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/tree"}},
                                        "id": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}}
RECURSIVE_CONTAINS = {  # arrays holding a tree (a grammar: contains at the root)
    "type": "array", "definitions": {"tree": TREE}, "maxItems": 3, "contains": {"$ref": "#/definitions/tree"},
}


def test_a_recursive_schema_has_no_negation():
    from constraints.schema.negation import negate

    assert negate({"$ref": "#/definitions/tree"}, RECURSIVE_CONTAINS) is None
    assert negate({"not": {"$ref": "#/definitions/tree"}}, RECURSIVE_CONTAINS) == {"$ref": "#/definitions/tree"}


def test_a_recursive_negation_leaves_the_other_rewrites(compiler, tok):
    from constraints.schema.analysis import rewrite_schema
    from constraints.schema.tree import subschemas

    out = rewrite_schema(RECURSIVE_CONTAINS)
    assert not any(isinstance(n, dict) and "oneOf" in n for _, n in subschemas(out))
    from .conftest import assert_classified

    assert_classified(compiler, tok, RECURSIVE_CONTAINS,
                      valid=[[{}], [{"kids": []}, 1], [2, {"kids": [{"id": 3}], "id": "a"}, "b"]],
                      invalid=[[], [1, 2], ["a"], [{"kids": [1]}], [{"id": 1.5}], [{"kids": [{"id": None}]}],
                               [{}, 1, 2, 3]])


# MaskBench JsonSchemaStore vtestunit: a $ref under a key no draft defines ("full"), reached only
# from another such target: the oneOf there is rewritten too (llguidance refused it as written)
NESTED_UNLISTED = {
    "$ref": "#/definitions/a/full",
    "definitions": {
        "a": {"full": {"type": "object", "properties": {"x": {"$ref": "#/definitions/b/full"}}}},
        "b": {"full": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}},
    },
}


def test_a_reference_inside_an_unlisted_target_is_rewritten(compiler, tok):
    from constraints.schema.analysis import rewrite_schema

    assert "oneOf" not in rewrite_schema(NESTED_UNLISTED)["definitions"]["b"]["full"]
    compiled = compiler.compile(ConstraintSpec("json_schema", NESTED_UNLISTED))
    for value in [{"x": "s"}, {"x": ["s", "t"]}, {}]:
        assert walk_json(compiled, tok, value), value
    for value in [{"x": 1}, {"x": [1]}]:
        assert not walk_json(compiled, tok, value), value


# MaskBench JsonSchemaStore hazelcast-config-5.3: an odd group size between 3 and 7
ODD_SIZE = {"type": "integer", "not": {"multipleOf": 2}, "minimum": 3, "maximum": 7}


def test_bounded_integers_beside_a_not_are_listed(compiler, tok):
    from constraints.schema.analysis import rewrite_schema

    assert rewrite_schema(ODD_SIZE) == {"enum": [3, 5, 7]}
    plain = {"type": "integer", "minimum": 3, "maximum": 7, "default": 4}
    assert rewrite_schema(plain) == plain  # nothing the backends skip: left to them
    compiled = compiler.compile(ConstraintSpec("json_schema", ODD_SIZE))
    for value in [3, 5, 7]:
        assert walk_json(compiled, tok, value), value
    for value in [1, 2, 4, 6, 8, 9, 5.5]:
        assert not walk_json(compiled, tok, value), value
