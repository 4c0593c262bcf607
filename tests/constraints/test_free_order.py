"""Larger objects accept their properties in any order (constraints/schema/runtime_checks.py,
"properties in any order"; constraints/backends/json_checks.py): valid objects are accepted in
every order tried, invalid ones are refused (a repeated key, a required key missing, a key a
closed object does not list, a wrong value), checked against jsonschema; random walks never get
stuck and always end valid; where freeing the order would not be exact the declared order stays;
``json_property_order: "declared"`` keeps it on request."""

from __future__ import annotations

import itertools
import random

import pytest

from constraints import ConstraintSpec, spec_from_request
from constraints.schema.analysis import rewrite_schema
from constraints.schema.runtime_checks import JsonCheck, PatternKey, split_runtime_checks

from .conftest import allowed_ids, assert_classified, new_mask, walk_json, walk_schemas_randomly, walk_text

S = {"type": "string", "maxLength": 8}
NAMES = ["name", "email", "product", "order_id", "issue", "priority"]
TICKET = {"type": "object", "properties": {n: S for n in NAMES}, "required": ["name", "email", "issue"],
          "additionalProperties": False}
FULL = {n: n[:3] for n in NAMES}
ANY = {"json_property_order": "any"}  # larger objects too (the default keeps their declared order)


def _orders(value: dict) -> list[dict]:
    items = list(value.items())
    rng = random.Random(len(items))
    shuffled = [dict(rng.sample(items, len(items))) for _ in range(3)]
    return [value, dict(reversed(items)), *shuffled]


CASES = [
    (  # closed: listed keys only, each once, the required ones before it closes
        TICKET,
        [*_orders(FULL), {"issue": "x", "email": "e", "name": "n"}, {"name": "n", "issue": "i", "email": "e"}],
        [{"name": "n", "email": "e"}, {"issue": "x", "email": "e", "name": "n", "extra": "y"}, {"issue": 1, "email": "e", "name": "n"}, {}],
    ),
    (  # open: other keys take additionalProperties, anywhere among the listed ones
        {**TICKET, "additionalProperties": {"type": "integer"}},
        [{"extra": 1, "issue": "x", "email": "e", "name": "n"}, {"issue": "x", "nam": 2, "email": "e", "name": "n"}],
        [{"extra": "s", "issue": "x", "email": "e", "name": "n"}, {"email": "e", "issue": "x"}],
    ),
    (  # under array items, through a $ref, beside a unique list inside it
        {"type": "array", "items": {"$ref": "#/$defs/t"}, "$defs": {"t": {
            **TICKET, "properties": {**TICKET["properties"], "tags": {"type": "array", "uniqueItems": True,
                                                                       "items": {"type": "string"}}}}}},
        [[dict(reversed(FULL.items())), {"tags": ["a", "b"], "name": "n", "email": "e", "issue": "i"}]],
        [[{"tags": ["a", "a"], "name": "n", "email": "e", "issue": "i"}], [{"name": "n", "email": "e"}]],
    ),
    (  # beside patterns no listed key matches, and other keywords that leave keys alone
        {**TICKET, "patternProperties": {"^x-": {"type": "integer"}}, "$comment": "c", "x-custom": {"k": 1},
         "allOf": [{"type": "object"}], "definitions": {"unused": {"required": ["a"]}}},
        [{"x-a": 1, "issue": "x", "email": "e", "x-b": 2, "name": "n"}],
        [{"x-a": "s", "issue": "x", "email": "e", "name": "n"}, {"x-a": 1, "issue": "x", "email": "e"}],
    ),
    (  # under the one pattern of a map that takes no other key (docker-compose's services)
        {"type": "object", "properties": {"version": S, "services": {
            "type": "object", "patternProperties": {"^[a-z]+$": {"$ref": "#/definitions/service"}},
            "additionalProperties": False}},
         "definitions": {"service": {
             "type": "object", "properties": {**{n: S for n in NAMES}, "ports": {
                 "type": "array", "uniqueItems": True, "items": {"type": "string"}}},
             "patternProperties": {"^x-": {}}, "additionalProperties": False, "required": ["name"]}}},
        [{"services": {"web": {"ports": ["80"], "x-a": [1], "name": "w"}, "db": {"issue": "i", "name": "d"}},
          "version": "3"}],
        [{"services": {"web": {"ports": ["80", "80"], "name": "w"}}}, {"services": {"web": {"issue": "i"}}},
         {"services": {"Web": {"name": "w"}}}, {"services": {"web": {"name": "w", "other": 1}}}],
    ),
    (  # property dependencies, checked as it closes
        {**TICKET, "$schema": "http://json-schema.org/draft-07/schema#",
         "dependencies": {"product": ["order_id"], "priority": ["issue", "product"]}},
        [{"issue": "x", "email": "e", "name": "n"}, {"order_id": "o", "product": "p", "issue": "x", "email": "e",
                                                      "name": "n"}, {**FULL}],
        [{"product": "p", "issue": "x", "email": "e", "name": "n"},
         {"priority": "p", "order_id": "o", "issue": "x", "email": "e", "name": "n"}],
    ),
    (  # a key no value can follow is never offered (the closed object could not go on)
        {**TICKET, "properties": {**TICKET["properties"], "never": False, "nix": False}},
        [{"issue": "x", "email": "e", "name": "n", "priority": "p"}],
        [{"issue": "x", "email": "e", "name": "n", "never": "p"}],
    ),
    (  # a closed object's finite pattern: its names are written once, like listed keys
        {**TICKET, "patternProperties": {"^\\$schema$": {"const": "s"}, "^(?:a|b)$": {"type": "integer"}}},
        [{"$schema": "s", "issue": "x", "a": 1, "email": "e", "name": "n", "b": 2}],
        [{"$schema": "t", "issue": "x", "email": "e", "name": "n"}, {"c": 1, "issue": "x", "email": "e", "name": "n"}],
    ),
    (  # nested: both levels freed
        {"type": "object", "properties": {**{n: S for n in "abcd"}, "inner": TICKET}, "additionalProperties": False},
        [{"inner": dict(reversed(FULL.items())), "d": "x", "a": "y"}],
        [{"inner": {"name": "n"}, "a": "y"}, {"a": "y", "b": 1}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_any_order_classifies_like_jsonschema(compiler, tok, schema, valid, invalid):
    assert any(c.free_keys for c in split_runtime_checks(rewrite_schema(schema))[1])
    assert_classified(compiler, tok, schema, valid, invalid, ANY)


@pytest.mark.parametrize("additional", [False, {"type": "integer"}])
def test_a_repeated_key_is_refused(compiler, tok, additional):
    compiled = compiler.compile(ConstraintSpec("json_schema", {**TICKET, "additionalProperties": additional}, ANY))
    assert walk_text(compiled, tok, '{"issue": "x", "email": "e", "name": "n"}')
    assert not walk_text(compiled, tok, '{"issue": "x", "email": "e", "name": "n", "email": "f"}')
    assert not walk_text(compiled, tok, '{"name": "n", "email": "e", "name": "m", "issue": "x"}')


@pytest.mark.parametrize("additional", [False, True, {"type": "string"}])
def test_keys_are_written_without_escapes(compiler, tok, additional):
    """The backend matches the exact-name patterns against the key as written: an escaped
    spelling of a listed key could reach additionalProperties while the checks count the key."""
    compiled = compiler.compile(ConstraintSpec("json_schema", {**TICKET, "additionalProperties": additional}, ANY))
    assert not walk_text(compiled, tok, '{"issue": "x", "email": "e", "n\\u0061me": "n"}')
    assert not walk_text(compiled, tok, '{"issue": "x", "email": "e", "name": "n", "n\\u0061me": 1}')
    assert walk_text(compiled, tok, '{"issue": "x", "email": "e\\u0041", "name": "n"}')
    # an escaped key that spells no listed one is an other key, where the object takes those
    other = '{"issue": "x", "email": "e", "name": "n", "caf\\u00e9": "x"}'
    assert walk_text(compiled, tok, other) == (additional is not False)


def test_a_used_name_of_a_finite_pattern_is_not_begun_again(compiler, tok):
    schema = {**TICKET, "patternProperties": {"^\\$schema$": {"const": "s"}}}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, ANY))
    assert walk_text(compiled, tok, '{"$schema": "s", "issue": "x", "email": "e", "name": "n"}')
    offered = _offered_after(compiler, tok, schema, '{"$schema": "s", "')
    assert offered and not any(t.startswith("$") for t in offered)


def test_every_order_of_a_small_subset(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", TICKET, ANY))
    for order in itertools.permutations(["name", "email", "issue", "priority"]):
        assert walk_json(compiled, tok, {k: k[:2] for k in order}), order


def test_a_pattern_map_is_a_path():
    paths = {c.path for c in split_runtime_checks(CASES[4][0])[1]}
    step = PatternKey(frozenset(), "^[a-z]+$")
    assert paths == {(), ("services", step), ("services", step, "ports")}  # (): the small open root


def test_the_checks_and_the_rewrite():
    stripped, checks = split_runtime_checks(TICKET)
    assert checks == (JsonCheck((), free_keys=tuple(NAMES), required=("email", "issue", "name"), closed=True),)
    assert "properties" not in stripped and "required" not in stripped
    assert list(stripped["patternProperties"]) == ["^(?:" + "|".join(NAMES) + ")$"]  # one value schema
    keys = {"type": "object", "properties": {f"a.{i}": {"type": "integer", "minimum": i} for i in range(5)}}
    assert list(split_runtime_checks(keys)[0]["patternProperties"]) == [f"^a\\.{i}$" for i in range(5)]
    many = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i} for i in range(100)}}
    assert split_runtime_checks(many) == (many, ())  # too many patterns for the backend's compile time


@pytest.mark.parametrize(
    "schema",
    [
        # fewer than five properties of a closed object: property_order spells the orders out
        {"type": "object", "properties": {n: S for n in "abcd"}, "additionalProperties": False},
        # ... or beside patterns (exact-name patterns beside them cost llguidance a proof)
        {"type": "object", "properties": {n: S for n in "abcd"}, "patternProperties": {"^x": S}},
        # another subschema at the same place binds the keys
        {"allOf": [TICKET, {"required": ["product"]}]},
        # one anyOf branch among objects of other keys
        {"anyOf": [TICKET, {"type": "object", "properties": {"x": S}}]},
        # the node says more than its properties
        {**TICKET, "patternProperties": {"^n": S}},  # "name" must also meet the pattern's subschema
        {**TICKET, "dependentRequired": {"name": ["email"]}},
        # a recursion: no path to check it at
        {"$defs": {"t": {"type": "object", "properties": {**{n: S for n in NAMES}, "child": {"$ref": "#/$defs/t"}}}},
         "$ref": "#/$defs/t"},
        # a reference into its properties
        {"type": "object", "properties": {**{n: S for n in NAMES}, "copy": {"$ref": "#/properties/name"}}},
        # a key whose pattern would not be plain
        {"type": "object", "properties": {**{n: S for n in NAMES}, 'say "hi"': S}},
    ],
)
def test_inexact_places_keep_the_declared_order(schema):
    assert split_runtime_checks(schema) == (schema, ())


def test_the_default_and_declared_order(compiler, tok):
    """By default (``auto``) a larger object keeps its declared order and a small one takes any;
    ``declared`` keeps every order; ``any`` is asked for by name."""
    assert spec_from_request({"structured_outputs": {"json": TICKET}}).options == {}
    spec = spec_from_request({"structured_outputs": {"json": TICKET, "json_property_order": "any"}})
    assert spec.options == ANY
    assert walk_json(compiler.compile(spec), tok, dict(reversed(FULL.items())))
    for options in ({}, {"json_property_order": "declared"}):
        compiled = compiler.compile(ConstraintSpec("json_schema", TICKET, options))
        assert walk_json(compiled, tok, FULL)
        assert not walk_json(compiled, tok, dict(reversed(FULL.items())))
    small = {"type": "object", "properties": {"b": S, "a": S}}
    assert walk_json(compiler.compile(ConstraintSpec("json_schema", small)), tok, {"a": "y", "b": "x"})
    small = {"type": "object", "properties": {"b": S, "a": S}}
    compiled = compiler.compile(ConstraintSpec("json_schema", small, {"json_property_order": "declared"}))
    assert walk_json(compiled, tok, {"b": "x", "a": "y"}) and not walk_json(compiled, tok, {"a": "y", "b": "x"})
    with pytest.raises(Exception, match="json_property_order"):
        spec_from_request({"structured_outputs": {"json": TICKET, "json_property_order": "sorted"}})


def test_random_walks_end_valid_and_never_stuck(compiler, tok):
    """Walks through the mask, often towards a quote or a brace: every state offers a token,
    every allowed token is accepted, every finished answer is valid."""
    walk_schemas_randomly(compiler, tok, [schema for schema, _, _ in CASES], ANY, seed=11, walks=4)


def _offered_after(compiler, tok, schema: dict, text: str) -> list[str]:
    """The texts of the tokens the mask offers once ``text`` is written."""
    matcher = compiler.compile(ConstraintSpec("json_schema", schema, ANY)).new_matcher()
    for t in tok.encode(text, add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    return [tok.decode([t]) for t in allowed_ids(mask)]


def test_a_closed_object_refuses_a_key_only_used_names_complete(compiler, tok):
    schema = {"type": "object", "properties": {n: S for n in ["ab", "abc", "x1", "x2", "x3"]},
              "additionalProperties": False}
    offered = _offered_after(compiler, tok, schema, '{"abc": "q", "ab": "r", "')
    assert not any(t.startswith("a") for t in offered) and any(t.startswith("x") for t in offered)


def test_a_small_open_object_takes_unlisted_keys_between_listed_ones(compiler, tok):
    # MaskBench JsonSchemaStore modernizrrc: {"$schema": ..., "classPrefix": ...} where only
    # "classPrefix" is listed; spelled-out orders write the unlisted keys last
    schema = {"type": "object", "properties": {"a": S, "b": {"type": "integer"}}}
    stripped, checks = split_runtime_checks(schema)
    assert checks == (JsonCheck((), free_keys=("a", "b")),)
    assert_classified(compiler, tok, schema, options=ANY,
                      valid=[{"x": 1, "b": 2}, {"a": "s", "x": [], "b": 0}, {"b": 1, "a": "t"}, {"x": 1}],
                      invalid=[{"a": "s", "b": "2"}, {"a": 1, "b": 1}, {"x": 1, "b": "c"}])
    declared = compiler.compile(ConstraintSpec("json_schema", schema))
    assert not walk_json(declared, tok, {"x": 1, "b": 2})  # the default mode keeps the declared order


def test_a_small_open_object_with_required_keys_keeps_the_spelled_out_orders():
    # its required keys stay in the grammar, where llguidance tells an unsatisfiable one
    # (MaskBench Glaiveai2K calculate_area_2f92f3ea: no instance at all) instead of a matcher
    # that can never close the object
    schema = {"type": "object", "properties": {"a": S, "b": S}, "required": ["a"]}
    assert split_runtime_checks(schema) == (schema, ())


def test_a_schema_written_as_lark_keeps_the_declared_order_under_any(compiler, tok):
    """The Lark form (a ``contains`` below an object's property) writes no patternProperties: it
    takes the declared-order schema, where freeing the order refused it (MaskBench
    JsonSchemaStore block, codux.config.schema)."""
    schema = {"type": "object", "properties": {**{n: S for n in NAMES},
                                               "tags": {"type": "array", "contains": {"const": "x"}}}}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, ANY))
    assert walk_json(compiled, tok, {"name": "n", "tags": ["a", "x"]})
    assert not walk_json(compiled, tok, {"name": "n", "tags": ["a"]})
