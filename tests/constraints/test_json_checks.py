"""Run-time checks (constraints/schema/runtime_checks.py, constraints/backends/json_checks.py):
uniqueItems over unbounded strings and key counts over open objects, checked on the text as it
is written. Valid instances are walked to EOS, invalid ones are refused (checked against
jsonschema), the mask and accept_token agree at every step (also through the batched fill),
rollback restores the checks' state, and where the check is not exact the keyword is still
refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.backends.batch_fill import fill_bitmasks
from constraints.backends.json_checks import JsonChecks
from constraints.schema.runtime_checks import JsonCheck, split_runtime_checks

from .conftest import VOCAB, allowed, allowed_ids, assert_classified, closing_tokens, new_mask, random_walk, walk_text

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}},
        "required": ["tags"]}
CASES = [
    (
        TAGS,
        [{"tags": []}, {"tags": ["a", "b"]}, {"tags": ["a", "ab", "b a", "A"]}, {"tags": ["é", "e"]}],
        [{"tags": ["a", "a"]}, {"tags": ["x", "y", "x"]}, {"tags": ["", ""]}, {"tags": ["é", "é"]}],
    ),
    (  # items through a $ref, minLength, inside an array of objects
        {"type": "array", "items": {"type": "object", "properties": {
            "names": {"type": "array", "uniqueItems": True, "items": {"$ref": "#/$defs/name"}}}},
         "$defs": {"name": {"type": "string", "minLength": 1}}},
        [[{"names": ["a"]}, {"names": ["a", "b"]}], [{"names": ["x", "y"]}, {"names": ["x"]}]],
        [[{"names": ["a", "a"]}], [{"names": ["x"]}, {"names": ["y", "z", "y"]}], [{"names": [""]}]],
    ),
    (  # listed strings, too many orders to enumerate: a prefix only repeats can finish is refused
        {"type": "array", "uniqueItems": True, "items": {"type": "string", "enum": ["a", "ab", "abc", "b", "c", "d", 7]}},
        [[], ["a", "ab"], ["d", "c", "b", "abc", "ab", "a"]],
        [["a", "a"], ["ab", "c", "ab"], ["d", "c", "b", "abc", "ab", "a", "a"], [7]],
    ),
    (  # objects that take further keys, compared whole as they close (members in any order, 1 == 1.0)
        {"type": "array", "uniqueItems": True, "items": {"type": "object", "properties": {"a": {"type": "number"}}}},
        [[{"a": 1}, {"a": 2}], [{"a": 1}, {"a": 1, "b": 2}], [{"a": 1}, {"b": 1}], [{}, {"c": {"x": [1]}}]],
        [[{"a": 1}, {"a": 1}], [{"a": 1, "b": 2}, {"b": 2, "a": 1}], [{"a": 1}, {"a": 1.0}], [{}, {}],
         [{"c": {"x": [1, "s"]}}, {"c": {"x": [1, "s"]}}]],
    ),
    (  # any values, compared whole: numbers by value, a used literal refused at its first letter
        {"type": "array", "uniqueItems": True},
        [[1, 2], [1, "1", True, None, [1], {"a": 1}], [[1, 2], [2, 1]], [0, False], ["a", "ab", 12, 1]],
        [[1, 1], [1, 1.0], [True, True], [None, None], [[1], [1]], [{"a": 1}, {"a": 1}], ["x", 1, "x"]],
    ),
    (  # integers (ids): a repeat can always be written on past (12 after 1)
        {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}}},
        [{"ids": [1, 12, 123]}, {"ids": [-1, 1, 0]}, {"ids": []}],
        [{"ids": [1, 1]}, {"ids": [5, 3, 5]}, {"ids": [0, -0]}],
    ),
    (  # a map: every key the object does not list holds a unique list (a listed key does not)
        {"type": "object", "properties": {"fixed": {"type": "array"}},
         "additionalProperties": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}},
        [{"a": ["x", "y"], "b": ["x"]}, {"fixed": ["x", "x"], "o": ["x"]}, {}],
        [{"a": ["x", "x"]}, {"fixed": [], "o": ["y", "z", "y"]}],
    ),
    (  # a key another subschema lists still takes this one's additionalProperties
        {"allOf": [{"properties": {"k": {"type": "array"}}},
                   {"additionalProperties": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}]},
        [{"k": ["x"], "z": ["x", "y"]}],
        [{"k": ["x", "x"]}, {"z": ["q", "q"]}],
    ),
    (  # names of a pattern every prefix of which goes on (MaskBench JsonSchemaStore bxci: variable names)
        {"type": "array", "uniqueItems": True, "items": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}},
        [["a", "a1", "A"], ["x_y", "x"], []],
        [["a", "a"], ["b", "c", "b"], ["1a"], [""]],
    ),
    (  # a minimum of keys over an object that takes any key
        {"type": "object", "minProperties": 2, "properties": {"a": {"type": "string"}}},
        [{"a": "x", "b": 1}, {"b": 1, "c": [1]}, {"a": "x", "b": {"c": {}}, "d": None}],
        [{}, {"a": "x"}, {"b": 1}],
    ),
    (  # a minimum over a map whose one pattern takes endless names (MaskBench Github_hard o74560)
        {"type": "object", "minProperties": 2, "patternProperties": {"^[a-z_]+$": {"type": "integer"}},
         "additionalProperties": False},
        [{"a": 1, "b": 2}, {"a": 1, "ab": 2, "abc": 3}],
        [{}, {"a": 1}, {"A": 1, "b": 2}, {"a": 1, "b": "x"}],
    ),
    (  # a maximum over an object that requires nothing
        {"type": "object", "maxProperties": 1, "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}},
        [{}, {"a": "x"}, {"b": 2}, {"zz": [1, 2]}],
        [{"a": "x", "b": 2}, {"a": "x", "q": 1}, {"p": 1, "q": 2}],
    ),
    (  # objects compared whole, with checks of other kinds inside (MaskBench JsonSchemaStore uproject:
        # unique modules, each with unique platform names and listed targets)
        {"type": "array", "uniqueItems": True, "items": {"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
            "targets": {"type": "array", "uniqueItems": True, "items": {"enum": ["a", "b"]}},
            "opts": {"type": "object", "minProperties": 1}}}},
        [[{"tags": ["x"]}, {"tags": ["x", "y"]}], [{"tags": ["x"], "n": 1}, {"tags": ["x"]}],
         [{"targets": ["a", "b"]}, {"targets": ["b", "a"]}], [{"opts": {"a": 1}}, {"opts": {"a": 2}}], [{}, {"q": []}]],
        [[{"tags": ["x", "x"]}], [{"tags": ["x"]}, {"tags": ["x"]}], [{"targets": ["a", "a"]}],
         [{"opts": {}}], [{"tags": ["x"], "n": 1}, {"n": 1, "tags": ["x"]}], [{}, {}]],
    ),
    (  # any string or a listed one (MaskBench JsonSchemaStore webextension permissions, vsix-publish
        # categories): every prefix goes on into endless strings, a repeat is refused at its quote
        {"type": "array", "uniqueItems": True, "items": {"anyOf": [
            {"type": "string", "minLength": 3}, {"enum": ["a", "tabs", "ab"]}, {"$ref": "#/$defs/x"}]},
         "$defs": {"x": {"const": "x"}}},
        [["a", "ab", "abc"], ["tabs", "tab"], ["x", "a"], []],
        [["a", "a"], ["tabs", "x", "tabs"], ["abc", "abc"], ["b"], ["x", "x"], [1]],
    ),
    (
        {"type": "object", "properties": {"inner": {"type": "object", "minProperties": 1, "maxProperties": 2}}},
        [{}, {"inner": {"a": 1}}, {"inner": {"a": 1, "b": {"c": 3, "d": 4, "e": 5}}}],
        [{"inner": {}}, {"inner": {"a": 1, "b": 2, "c": 3}}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_runtime_checks_classify_like_jsonschema(compiler, tok, schema, valid, invalid):
    assert split_runtime_checks(schema)[1]
    assert_classified(compiler, tok, schema, valid, invalid)


def test_escaped_and_raw_spellings_of_one_string_are_one_item(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", TAGS))
    assert walk_text(compiled, tok, '{"tags": ["\\u0041", "B"]}')
    assert not walk_text(compiled, tok, '{"tags": ["A", "\\u0041"]}')
    assert not walk_text(compiled, tok, '{"tags": ["a\\"b", "a\\u0022b"]}')


def test_a_repeated_key_is_refused_in_a_counted_object(compiler, tok):
    schema = {"type": "object", "minProperties": 2}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert not walk_text(compiled, tok, '{"x": 1, "x": 2}')
    assert walk_text(compiled, tok, '{"x": 1, "y": 2}')


@pytest.mark.parametrize(
    "schema",
    [
        # one branch allows repeats: checking the path would refuse valid arrays
        {"anyOf": [{"type": "array", "uniqueItems": True, "items": {"type": "string"}}, {"type": "array"}]},
        # a bounded string domain could leave a repeat no way on
        {"type": "array", "uniqueItems": True, "items": {"type": "string", "maxLength": 1}},
        # bounded numbers: a repeat could have no way on (written on past, 3 becomes 30 > 3)
        {"type": "array", "uniqueItems": True, "items": {"type": "integer", "maximum": 3}},
        # closed objects: a repeat written whole could have no way on
        {"type": "array", "uniqueItems": True, "items": {"type": "object", "additionalProperties": False,
                                                         "properties": {"a": {"type": "string"}}}},
        # under a not, removing the keyword would change the complement
        {"type": "object", "properties": {"a": {"not": {"type": "array", "uniqueItems": True}}}},
        # a maximum beside a required key could be reached with that key still missing
        {"type": "object", "maxProperties": 1, "required": ["b"], "properties": {"a": {}, "b": {}}},
        # the same subschema at a fixed path and at a position (prefixItems): no path for the latter
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/u"}, "b": {"prefixItems": [{"$ref": "#/$defs/u"}]}},
         "$defs": {"u": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}},
        # fewer listed values than the items required: the array would run out
        {"type": "array", "uniqueItems": True, "minItems": 3, "items": {"enum": ["a", "b", "c", "d", "e", "f", "g"][:2] * 4}},
        # a dynamic reference this module does not follow
        {"$defs": {"u": {"$dynamicAnchor": "u", "type": "array", "uniqueItems": True, "items": {"type": "string"}}},
         "type": "object", "properties": {"a": {"$dynamicRef": "#u"}}},
        # a map beside patterns: which subschema takes a key is the pattern's to say
        {"type": "object", "patternProperties": {"^a": {}},
         "additionalProperties": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}},
        # strings a pattern ends ("12x" takes nothing after its x): a repeat could leave no way on
        {"type": "array", "uniqueItems": True, "items": {"type": "string", "pattern": "^[0-9]+x$"}},
        # two patterns: what they take together is not checked here
        {"type": "array", "uniqueItems": True,
         "items": {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}},
        # listed strings beside bounded ones: "ab" could have no way on
        {"type": "array", "uniqueItems": True, "items": {"anyOf": [{"type": "string", "maxLength": 2}, {"enum": ["a"]}]}},
        # listed values beside any string, one of them no string: a used 7 has no way on
        {"type": "array", "uniqueItems": True, "items": {"anyOf": [{"type": "string"}, {"enum": ["a", 7]}]}},
        # any string in one array branch, numbers in the other
        {"anyOf": [{"type": "array", "uniqueItems": True, "items": {"anyOf": [{"type": "string"}, {"enum": ["a"]}]}},
                   {"type": "array", "uniqueItems": True, "items": {"type": "number", "maximum": 3}}]},
        # keys under a pattern: a minimum could find no further key
        {"type": "object", "minProperties": 3, "patternProperties": {"^[ab]$": {}}, "additionalProperties": False},
    ],
)
def test_inexact_places_keep_the_keyword(schema):
    assert split_runtime_checks(schema, free_order=False) == (schema, ())


def test_items_compared_whole_inside_items_compared_whole_keep_the_outer_keyword():
    # the matcher keeps one whole item's text at a time: the inner arrays are checked, the
    # outer keeps its keyword (MaskBench JsonSchemaStore rust-project: unique crates of unique deps)
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "object", "properties": {
        "deps": {"type": "array", "uniqueItems": True, "items": {"type": "object"}}}}}
    stripped, checks = split_runtime_checks(schema, free_order=False)
    assert [c.path for c in checks] == [(None, "deps")]
    assert stripped["uniqueItems"] is True and "uniqueItems" not in stripped["items"]["properties"]["deps"]


def test_a_recursive_schema_keeps_the_keyword(compiler):
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert split_runtime_checks(schema)[1] == ()
    with pytest.raises(UnsupportedConstraintError, match="uniqueItems"):
        compiler.compile(ConstraintSpec("json_schema", schema))


def test_listed_items_run_out(compiler, tok):
    schema = CASES[2][0]
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    matcher = compiled.new_matcher()
    for t in tok.encode('["a", "ab", "abc"', add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = _mask(matcher)
    assert not any(allowed(mask, t) for t in allowed_ids(mask) if '"a' in tok.decode([t]))
    for t in tok.encode(', "b", "c", "d"', add_special_tokens=False):
        assert matcher.accept_token(t)
    assert {tok.decode([t]) for t in allowed_ids(_mask(matcher))} == {"]"}


def test_checks_name_their_paths():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "array", "uniqueItems": True, "items": {"type": "string"}}}}}
    stripped, checks = split_runtime_checks(schema, free_order=False)
    assert checks == (JsonCheck(("a", None), unique_items=True),)
    assert "uniqueItems" not in json.dumps(stripped) and "uniqueItems" in json.dumps(schema)


# MaskBench JsonSchemaStore host: both oneOf branches (two versions of one file format) list
# one definition of unique strings; the second branch reaching it must not read as a recursion
SHARED_BY_BRANCHES = {
    "$defs": {"names": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
              "v1": {"type": "object", "properties": {"names": {"$ref": "#/$defs/names"}, "a": {"type": "integer"}},
                     "required": ["a"], "additionalProperties": False},
              "v2": {"type": "object", "properties": {"names": {"$ref": "#/$defs/names"}, "b": {"type": "integer"}},
                     "required": ["b"], "additionalProperties": False}},
    "oneOf": [{"$ref": "#/$defs/v1"}, {"$ref": "#/$defs/v2"}],
}


def test_a_definition_two_branches_share_is_checked(compiler, tok):
    stripped, checks = split_runtime_checks(SHARED_BY_BRANCHES, free_order=False)
    assert checks == (JsonCheck(("names",), unique_items=True),)
    assert "uniqueItems" not in json.dumps(stripped)
    assert_classified(compiler, tok, SHARED_BY_BRANCHES, valid=[{"a": 1, "names": ["x", "y"]}, {"b": 2, "names": []}],
                      invalid=[{"a": 1, "names": ["x", "x"]}, {"b": 1, "names": ["y", "y"]}, {"a": 1, "b": 2}])


def _wrapped(matcher):
    """``matcher`` and the matchers it narrows, outermost first."""
    while matcher is not None:
        yield matcher
        matcher = matcher.__dict__.get("inner")


def _mask(matcher) -> torch.Tensor:
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    return mask


def test_the_mask_refuses_exactly_the_closing_tokens_of_a_repeat(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", TAGS))
    matcher = compiled.new_matcher()
    assert any(isinstance(m, JsonChecks) for m in _wrapped(matcher))
    for t in tok.encode('{"tags": ["red", "red', add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = _mask(matcher)
    closing = [i for i in range(VOCAB) if tok.decode([i]).startswith('"')]
    assert len(closing) > 10 and not any(allowed(mask, i) for i in closing)
    for i in closing:
        assert not matcher.accept_token(i)
    d = tok.encode("d", add_special_tokens=False)[0]
    assert allowed(mask, d) and matcher.accept_token(d)
    assert allowed(_mask(matcher), tok.encode('"', add_special_tokens=False)[0])  # "redd" is new
    matcher.rollback(1)
    assert allowed_ids(_mask(matcher)) == allowed_ids(mask)


def test_mask_and_accept_agree_on_random_walks(compiler, tok):
    """Random walks through the mask, half the time towards closing a string or container:
    every allowed token is accepted, every finished answer is valid, and the batched fill
    gives the same rows."""
    import jsonschema

    closers = closing_tokens(tok, '"]}')
    rng = random.Random(7)
    for schema, _, _ in CASES:
        compiled = compiler.compile(ConstraintSpec("json_schema", schema))
        check = jsonschema.Draft202012Validator(schema).is_valid
        for _ in range(3):
            matcher = compiled.new_matcher()

            def batched_like_alone(mask, matcher=matcher):
                batch = torch.zeros((2, mask.shape[1]), dtype=torch.int32)
                fill_bitmasks([matcher, matcher], batch)  # two rows: the batched path
                assert torch.equal(batch[0], mask[0]) and torch.equal(batch[1], mask[0])

            random_walk(matcher, tok, rng, 40, closers, 0.5, check, batched_like_alone)


def test_a_token_closing_one_checked_object_and_opening_another(compiler, tok):
    schema = {"type": "array", "items": {"type": "object", "minProperties": 1}}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    matcher = compiled.new_matcher()
    for t in tok.encode('[{"a": 1', add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = _mask(matcher)
    opened_empty = [t for t in allowed_ids(mask) if "{}" in tok.decode([t])]
    assert not opened_empty and not walk_text(compiled, tok, '[{"a": 1},{}]')


def test_a_property_named_like_a_keyword_is_only_a_name():
    schema = {"type": "object", "properties": {"extends": {"type": "string"}, "tags": {
        "type": "array", "uniqueItems": True, "items": {"type": "string"}}}}
    assert split_runtime_checks(schema, free_order=False)[1] == (JsonCheck(("tags",), unique_items=True),)


@pytest.mark.parametrize("name", ["dependencies", "not", "if", "contains", "propertyNames", "prefixItems"])
def test_a_property_named_like_an_opaque_keyword_is_placed(name):
    # MaskBench JsonSchemaStore drupal-migration: {"dependencies": {"properties": {"config": ...}}}
    schema = {"type": "object", "properties": {name: {"type": "object", "properties": {"tags": {
        "type": "array", "uniqueItems": True, "items": {"type": "string"}}}}}}
    assert split_runtime_checks(schema, free_order=False)[1] == (JsonCheck((name, "tags"), unique_items=True),)


def test_order_free_objects_compared_whole(compiler, tok):
    # MaskBench JsonSchemaStore uplugin: unique plugin references of many properties, taken in
    # any order ("json_property_order": "any"), two required; a repeat in another order is one
    schema = {"type": "array", "uniqueItems": True, "items": {
        "type": "object", "required": ["Name", "Enabled"], "properties": {
            "Name": {"type": "string"}, "Enabled": {"type": "boolean"}, "Optional": {"type": "boolean"},
            "Description": {"type": "string"}, "Url": {"type": "string"},
            "Platforms": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}}}
    options = {"json_property_order": "any"}
    assert any(c.free_keys for c in split_runtime_checks(schema)[1])
    assert_classified(compiler, tok, schema,
                      [[{"Name": "a", "Enabled": True}, {"Enabled": True, "Name": "b"}],
                       [{"Name": "a", "Enabled": True}, {"Name": "a", "Enabled": True, "x": 1}],
                       [{"Platforms": ["w", "l"], "Name": "a", "Enabled": False}]],
                      [[{"Name": "a", "Enabled": True}, {"Enabled": True, "Name": "a"}],
                       [{"Name": "a", "Enabled": True, "Platforms": ["w", "w"]}], [{"Name": "a"}]], options)
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, options))
    assert not walk_text(compiled, tok, '[{"Name": "a", "Enabled": true, "Name": "b"}]')  # a repeated key
    assert walk_text(compiled, tok, '[{"Name": "a", "Enabled": true}, {"Name": "a", "Enabled": false}]')
