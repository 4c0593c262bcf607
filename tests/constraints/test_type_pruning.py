"""anyOf branches whose types the conjuncts beside them rule out are dropped
(constraints/schema/type_pruning.py): a contains left by a negation where only strings can be
has nothing to enforce."""

from __future__ import annotations

import json

import jsonschema

from constraints.schema.analysis import rewrite_schema
from constraints.schema.type_pruning import prune_typed_branches

from .conftest import assert_classified

ARRAY_OR_LONG = {"anyOf": [{"type": "array", "contains": {"type": "number"}}, {"type": "string", "minLength": 2}]}


def test_a_branch_of_a_type_a_sibling_excludes_is_dropped():
    schema = {"allOf": [{"properties": {"x": {"type": "string"}}}, {"properties": {"x": ARRAY_OR_LONG}}]}
    out = prune_typed_branches(schema)
    assert out["allOf"][1]["properties"]["x"]["anyOf"] == [{"type": "string", "minLength": 2}]
    assert schema["allOf"][1]["properties"]["x"] == ARRAY_OR_LONG  # the input is not modified


def test_a_shared_subschema_is_pruned_only_where_it_is_ruled_out():
    shared = json.loads(json.dumps(ARRAY_OR_LONG))
    schema = {"properties": {"a": {"allOf": [{"type": "string"}, shared]}, "b": shared}}
    out = prune_typed_branches(schema)
    assert out["properties"]["a"]["allOf"][1]["anyOf"] == [{"type": "string", "minLength": 2}]
    assert out["properties"]["b"] == ARRAY_OR_LONG


def test_no_branch_fitting_leaves_the_any_of():
    schema = {"type": "object", "anyOf": [{"type": "string"}, {"type": "array"}]}
    assert prune_typed_branches(schema) == schema


# MaskBench JsonSchemaStore grunt-watch-task: events as a list of event names or one name; the
# exclusive form has "events is not a list of names" beside "events is a name"
EVENTS = {
    "type": "object",
    "oneOf": [{"properties": {"events": {"type": "array", "items": {"$ref": "#/definitions/event"}}}},
              {"properties": {"events": {"$ref": "#/definitions/event"}}}],
    "definitions": {"event": {"type": "string", "enum": ["all", "changed"]}},
}


def test_one_of_over_a_list_or_one_value_needs_no_contains(compiler, tok):
    assert "contains" not in json.dumps(rewrite_schema(EVENTS))
    values = [{"events": ["all"]}, {"events": "changed"}, {"events": []}, {}, {"events": "added"},
              {"events": ["added"]}, {"events": 1}, {"events": ["all", 1]}]
    check = jsonschema.Draft7Validator(EVENTS).is_valid
    assert_classified(compiler, tok, EVENTS, valid=[v for v in values if check(v)],
                      invalid=[v for v in values if not check(v)])


# -- objects that must hold a key they rule out -----------------------------------------------------
# MaskBench Github_hard o4197: one reference kind requires "weblink" but lists only "type", "url"
# and "anchor" beside additionalProperties: false; no object is one (llguidance refused the
# whole schema for it), the other kinds stay
URL_REFERENCE = {"type": "object", "properties": {"type": {"const": "url"}, "url": {"type": "string"}},
                 "required": ["type", "weblink"], "additionalProperties": False}
REFERENCES = {"type": "array", "items": {"anyOf": [
    {"$ref": "#/$defs/url"},
    {"type": "object", "properties": {"type": {"const": "book"}, "chapter": {"type": "string"}},
     "required": ["type", "chapter"], "additionalProperties": False}]}, "$defs": {"url": URL_REFERENCE}}


def test_a_closed_object_requiring_an_unlisted_key_is_false():
    out = rewrite_schema(REFERENCES)
    assert out["$defs"]["url"] is False
    assert [b["required"] for b in out["items"]["anyOf"]] == [["type", "chapter"]]


def test_a_branch_no_object_meets_is_dropped(compiler, tok):
    assert_classified(compiler, tok, REFERENCES,
                      [[], [{"type": "book", "chapter": "1"}]],
                      [[{"type": "url", "url": "u"}], [{"type": "url", "url": "u", "weblink": "w"}],
                       [{"type": "book"}]])


# MaskBench JsonSchemaStore typo3: a closed route whose if/then/else requires "source" or
# "content", neither listed: no route is valid, so routes is an empty list
ROUTES = {"type": "object", "properties": {"routes": {"type": "array", "items": {
    "type": "object", "properties": {"route": {"type": "string"}, "type": {"enum": ["uri", "staticText"]}},
    "if": {"properties": {"type": {"const": "uri"}}},
    "then": {"properties": {"source": {"type": "string"}}, "required": ["source"]},
    "else": {"properties": {"content": {"type": "string"}}, "required": ["content"]},
    "required": ["route", "type"], "additionalProperties": False}}}}


def test_every_branch_requiring_an_unlisted_key_rules_the_object_out(compiler, tok):
    assert rewrite_schema(ROUTES)["properties"]["routes"]["items"] is False
    assert_classified(compiler, tok, ROUTES, [{}, {"routes": []}],
                      [{"routes": [{"route": "r", "type": "uri", "source": "s"}]},
                       {"routes": [{"route": "r", "type": "staticText"}]}, {"routes": [{}]}])


def test_a_required_false_property_leaves_the_other_types(compiler, tok):
    # no type at the root (MaskBench Github_hard o4851): every value but an object is valid
    schema = {"properties": {"gone": False, "name": {"type": "string"}}, "required": ["gone"]}
    assert_classified(compiler, tok, schema, ["x", 1, [1], None, True], [{}, {"gone": 1}, {"name": "n"}])


def test_an_unlisted_key_an_object_may_hold_is_kept():
    for schema in (
        {"type": "object", "properties": {"a": {}}, "required": ["b"]},  # open: b takes any value
        {"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False,
         "patternProperties": {"^b$": {}}},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False,
         "anyOf": [{"required": ["b"]}, {"required": ["a"]}]},
    ):
        assert isinstance(rewrite_schema(schema), dict) and rewrite_schema(schema).get("type") == "object", schema
