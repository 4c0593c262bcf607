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
