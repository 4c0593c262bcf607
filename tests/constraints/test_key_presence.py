"""Objects whose keys a schema binds by presence alone, in any order (constraints/schema/key_presence.py,
the ``presence`` of an order-free object's check in runtime_checks.py, enforced by
constraints/backends/json_checks.py): ``oneOf`` over required key sets, its "this branch and not
the others" rewrite, ``not: {required}``, with dependencies beside; valid objects are accepted in
every order tried and invalid ones refused (checked against jsonschema), random walks never get
stuck, and the rewrite keeps what the removed subschemas said of non-objects."""

from __future__ import annotations

import pytest

from constraints import ConstraintSpec
from constraints.schema.analysis import rewrite_schema
from constraints.schema.key_presence import KeyPresence, dependency_formula, holds, other_types, presence_formula
from constraints.schema.runtime_checks import split_runtime_checks

from .conftest import allowed_ids, assert_classified, new_mask, walk_json, walk_schemas_randomly

ANY = {"json_property_order": "any"}
N = {"type": "number"}
SHAPES = {"type": "object", "required": ["shape"],
          "properties": {"shape": {"enum": ["circle", "rectangle", "triangle"]}, "radius": N, "length": N,
                         "width": N, "base": N, "height": N},
          "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}, {"required": ["base", "height"]}]}


def test_formulas_read_presence_alone():
    one_of = presence_formula({"oneOf": SHAPES["oneOf"]})
    assert holds(one_of, frozenset({"radius"})) and holds(one_of, frozenset({"length", "width", "base"}))
    assert not holds(one_of, frozenset({"radius", "length", "width"})) and not holds(one_of, frozenset())
    absent = presence_formula({"type": "object", "properties": {"a": False, "b": False}})
    assert holds(absent, frozenset({"c"})) and not holds(absent, frozenset({"b"}))
    assert not holds(presence_formula({"not": {"required": ["a", "b"]}}), frozenset({"a", "b"}))
    restating = {"properties": {"a": {"type": ["string", "null"]}, "b": True}, "required": ["a"]}
    assert holds(presence_formula(restating, {"a": {"type": "string", "maxLength": 3}}), frozenset({"a"}))
    contradicting = presence_formula(restating, {"a": {"type": "integer"}})  # a must be absent, and present
    assert not holds(contradicting, frozenset({"a"})) and not holds(contradicting, frozenset())
    assert presence_formula({"properties": {"a": {"type": "string", "maxLength": 3}}}, {"a": {"type": "string"}}) is None
    for saying_more in ({"required": ["a"], "minProperties": 2}, {"properties": {"a": {"type": "string"}}},
                        {"anyOf": [{"required": ["a"]}, {"$ref": "#/x"}]}, {"required": "a"}):
        assert presence_formula(saying_more) is None
    # what the subschemas say of values that are not objects: required and properties nothing
    assert other_types([presence_formula({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]})]) == (
        "null", "boolean", "array", "string", "number", "integer")
    assert other_types([presence_formula({"type": "object", "required": ["a"]})]) == ()
    assert other_types([presence_formula({"not": {"required": ["a"]}})]) == ()  # not(true) on a string


def test_key_sets_and_the_two_questions():
    formula = presence_formula({"oneOf": SHAPES["oneOf"]})
    presence = KeyPresence.of([formula, ("has", "shape")], {"shape", "radius", "length", "width", "base", "height"})
    assert presence.admits(frozenset({"shape", "length"}), "width")
    assert not presence.admits(frozenset({"shape", "length", "width"}), "radius")
    assert presence.admits(frozenset({"shape", "length", "width"}), "base")  # base without height stays one
    assert not presence.complete(frozenset({"shape", "length"})) and presence.complete(frozenset({"shape", "radius"}))
    assert presence.refused(frozenset({"radius"})) == []  # length alone, base alone: still one branch
    assert presence.refused(frozenset({"radius", "length"})) == ["width"]
    # a needed key that cannot be written, too many keys, no set at all: no check
    assert KeyPresence.of([("has", "a")], set()) is None
    assert KeyPresence.of([("has", f"k{i}") for i in range(13)], {f"k{i}" for i in range(13)}) is None
    assert KeyPresence.of([("has", "a"), ("lacks", "a")], {"a"}) is None
    needs = KeyPresence.of([dependency_formula("a", ["b"])], {"a", "b"})
    assert needs.allowed == {frozenset(), frozenset({"b"}), frozenset({"a", "b"})}


CASES = [
    (  # exactly one shape's keys: the oneOf rewritten as "this branch and not the others"
        SHAPES,
        [{"radius": 1, "shape": "circle"}, {"width": 2, "shape": "rectangle", "length": 3},
         {"height": 1, "base": 2, "shape": "triangle"}, {"width": 2, "shape": "rectangle", "length": 3, "base": 1}],
        [{"shape": "circle"}, {"radius": 1}, {"radius": 1, "shape": "circle", "width": 2, "length": 2},
         {"length": 1, "shape": "rectangle"}, {"radius": 1, "shape": "square"}, "circle"],
    ),
    (  # closed, with a node-level not and a dependency beside
        {"type": "object", "additionalProperties": False, "dependentRequired": {"e": ["a"]},
         "properties": {k: {"type": "integer"} for k in "abcde"}, "not": {"required": ["a", "b"]}},
        [{"c": 1, "a": 2}, {"b": 1, "d": 2, "c": 3}, {}, {"e": 1, "c": 0, "a": 5}],
        [{"b": 1, "a": 2}, {"a": 1, "c": 2, "b": 3}, {"e": 1}, {"e": 1, "b": 2}, {"f": 1}],
    ),
    (  # a few keys, with branches restating a key's own type (MaskBench JsonSchemaStore rust-toolchain)
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
         "properties": {"path": {"type": "string"}, "channel": {"type": "string"}, "profile": {"type": "string"}},
         "oneOf": [{"not": {"properties": {"path": {"type": "string"}}, "required": ["path"]}}, {"required": ["path"]}],
         "dependencies": {"path": {"not": {"properties": {"channel": {"type": "string"}}, "required": ["channel"]}}}},
        [{"profile": "p", "channel": "c"}, {"path": "p"}, {"profile": "x", "path": "p", "other": 1}, {}],
        [{"path": "p", "channel": "c"}, {"channel": "c", "path": "p"}, {"path": 1}],
    ),
    (  # open, anyOf of absences and a required set, under array items
        {"type": "array", "items": {
            "type": "object", "properties": {k: {"type": "string"} for k in "pqrst"},
            "anyOf": [{"properties": {"p": False, "q": False}}, {"required": ["p", "q", "r"]}]}},
        [[{"x": 1, "s": "s"}, {"r": "r", "q": "q", "p": "p", "y": 2}, {"r": "r"}]],
        [[{"q": "q"}], [{"s": "s"}, {"p": "p", "r": "r"}], [{"p": "p"}]],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_presence_bound_objects_take_any_order(compiler, tok, schema, valid, invalid):
    checks = split_runtime_checks(rewrite_schema(schema))[1]
    assert any(c.presence is not None and c.free_keys for c in checks)
    assert_classified(compiler, tok, schema, valid, invalid, ANY)


def test_a_key_no_allowed_set_holds_is_not_offered(compiler, tok):
    schema = {**SHAPES, "additionalProperties": False}
    matcher = compiler.compile(ConstraintSpec("json_schema", schema, ANY)).new_matcher()
    for t in tok.encode('{"length": 1, "width": 2, "', add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    offered = [tok.decode([t]) for t in allowed_ids(mask)]
    assert any(t.startswith("s") for t in offered) and any(t.startswith("b") for t in offered)
    assert not any(t.startswith("r") or t.startswith("l") for t in offered)


def test_the_removed_subschemas_still_refuse_non_objects(compiler, tok):
    # the rewrite of a oneOf carries the node's type in its branches only
    untyped = {k: v for k, v in SHAPES.items() if k != "type"}
    stripped, checks = split_runtime_checks(rewrite_schema(untyped))
    assert checks and checks[0].presence is not None and "oneOf" not in stripped and "allOf" not in stripped
    compiled = compiler.compile(ConstraintSpec("json_schema", untyped, ANY))
    assert not walk_json(compiled, tok, "circle") and not walk_json(compiled, tok, 3)
    assert walk_json(compiled, tok, {"radius": 1, "shape": "circle"})


def test_the_default_order_frees_small_objects_only(compiler, tok):
    """By default an object of at most four properties takes any order (spelled out where no
    subschema binds its keys, by these checks where one binds them by presence); a larger one
    keeps its declared order."""
    small = {"type": "object", "required": ["shape"], "oneOf": [{"required": ["rectangle"]}, {"required": ["circle"]}],
             "properties": {"shape": {"enum": ["rectangle", "circle"]}, "circle": N, "rectangle": N}}
    assert_classified(compiler, tok, small, options={},
                      valid=[{"rectangle": 1, "shape": "rectangle"}, {"shape": "circle", "circle": 2}],
                      invalid=[{"shape": "circle"}, {"circle": 1, "rectangle": 2, "shape": "circle"}])
    compiled = compiler.compile(ConstraintSpec("json_schema", SHAPES))
    assert walk_json(compiled, tok, {"shape": "circle", "radius": 1})
    assert not walk_json(compiled, tok, {"radius": 1, "shape": "circle"})  # declared: shape first


def test_random_walks_end_valid_and_never_stuck(compiler, tok):
    walk_schemas_randomly(compiler, tok, [schema for schema, _, _ in CASES], ANY, seed=5, walks=5)
