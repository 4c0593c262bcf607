"""``$ref`` to any ``$id`` / ``$anchor`` / ``$dynamicAnchor`` declared anywhere in the document
(constraints/schema/references.py): base URIs resolved through nested ``$id``s, also under
``if``, ``not`` and ``$defs``; ``$dynamicRef`` through the dynamic scope (a copy per scope where
the path decides); every reference rewritten as a JSON pointer from the root."""

from __future__ import annotations

import pytest

from constraints import (
    ConstraintSpec,
    InvalidConstraintError,
    UnsupportedConstraintError,
)
from constraints.schema.analysis import normalise_schema

from .conftest import assert_classified

DRAFT = "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize(("schema", "valid", "invalid"), [
    # the $id sits under an "if" with no "then": the if asserts nothing, the reference does
    ({"$schema": DRAFT, "$ref": "http://example.com/ref/if", "if": {"$id": "http://example.com/ref/if", "type": "integer"}},
     [1, -3], ["a", 1.5, None]),
    # resolved against the nearest base (b/c.json), under a "not"
    ({"$schema": DRAFT, "$id": "http://example.com/a.json", "allOf": [{"$ref": "http://example.com/b/d.json"}],
      "$defs": {"x": {"$id": "http://example.com/b/c.json", "not": {"$defs": {"y": {"$id": "d.json", "type": "number"}}}}}},
     [1, 2.5], ["a", [], None]),
    # a relative reference between two resources, recursively
    ({"$schema": DRAFT, "$id": "http://localhost:1234/tree", "type": "object", "required": ["meta", "nodes"],
      "properties": {"meta": {"type": "string"}, "nodes": {"type": "array", "items": {"$ref": "node"}}},
      "$defs": {"node": {"$id": "http://localhost:1234/node", "type": "object", "required": ["value"],
                         "properties": {"value": {"type": "number"}, "subtree": {"$ref": "tree"}}}}},
     [{"meta": "r", "nodes": [{"value": 1, "subtree": {"meta": "c", "nodes": []}}]}],
     [{"meta": "r", "nodes": [{"value": "1"}]}, {"meta": "r", "nodes": [{"value": 1, "subtree": {"meta": 1, "nodes": []}}]}]),
    # an $anchor inside a nested resource, named through that resource's URI
    ({"$schema": DRAFT, "$id": "http://x.org/root", "type": "array", "items": {"$ref": "inner#name"},
      "$defs": {"a": {"$id": "inner", "$defs": {"b": {"$anchor": "name", "type": "string", "maxLength": 2}}}}},
     [["ab", ""]], [["abc"], [1]]),
    # $dynamicRef: the root resource declares the anchor, so it wins whatever the path
    ({"$schema": DRAFT, "$id": "https://t.org/root", "$ref": "list",
      "$defs": {"foo": {"$dynamicAnchor": "items", "type": "string"},
                "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#items"},
                         "$defs": {"items": {"$dynamicAnchor": "items"}}}}},
     [["a"], []], [[1], ["a", 2]]),
    # a "then" without an "if" asserts nothing, and a reference into it still resolves
    ({"$schema": DRAFT, "$ref": "http://example.com/ref/then", "then": {"$id": "http://example.com/ref/then", "type": "integer"}},
     [7], ["x"]),
])
def test_references_resolve_anywhere(compiler, tok, schema, valid, invalid):
    assert_classified(compiler, tok, schema, valid, invalid)


def test_references_become_pointers_and_identifiers_go():
    schema = {"$schema": DRAFT, "$id": "http://e.org/a", "$ref": "b#n",
              "$defs": {"b": {"$id": "b", "$defs": {"c": {"$anchor": "n", "$dynamicAnchor": "m", "type": "null"}}}}}
    out = normalise_schema(schema)
    assert out["$ref"] == "#/$defs/b/$defs/c"
    assert out["$defs"]["b"]["$defs"]["c"] == {"type": "null"} and "$id" not in out["$defs"]["b"]


def test_a_key_needing_escapes_is_a_uri_fragment():
    schema = {"$defs": {"a b%": {"type": "null"}, "x/y": {"type": "null"}}, "anyOf": [
        {"$ref": "#/$defs/a%20b%25"}, {"$ref": "#/$defs/x~1y"}]}
    out = normalise_schema(schema)
    assert [b["$ref"] for b in out["anyOf"]] == ["#/$defs/a%20b%25", "#/$defs/x~1y"]


def test_a_reference_to_a_boolean_schema_is_that_schema():
    schema = {"$defs": {"t": True, "f": False}, "properties": {"a": {"$ref": "#/$defs/f"}, "b": {"$ref": "#/$defs/t"}}}
    assert normalise_schema(schema)["properties"] == {"a": False, "b": True}


def test_a_legacy_id_that_is_no_base_keeps_root_pointers():
    """Schema generators write ``"id": "/properties/a"`` (draft 4): a ``#/definitions/…`` under it
    that resolves nowhere in that "resource" is read from the document root."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "definitions": {"n": {"type": "integer"}},
              "properties": {"a": {"id": "/properties/a", "properties": {"b": {"$ref": "#/definitions/n"}}}}}
    assert normalise_schema(schema)["properties"]["a"]["properties"]["b"]["$ref"] == "#/definitions/n"


LISTS = {"$schema": DRAFT, "$id": "https://t.org/main",
         "if": {"properties": {"kind": {"const": "n"}}, "required": ["kind"]},
         "then": {"$ref": "numberList"}, "else": {"$ref": "stringList"},
         "$defs": {"genericList": {"$id": "genericList", "properties": {"list": {"items": {"$dynamicRef": "#t"}}},
                                   "$defs": {"d": {"$dynamicAnchor": "t"}}},
                   "numberList": {"$id": "numberList", "$ref": "genericList",
                                  "$defs": {"t": {"$dynamicAnchor": "t", "type": "number"}}},
                   "stringList": {"$id": "stringList", "$ref": "genericList",
                                  "$defs": {"t": {"$dynamicAnchor": "t", "type": "string"}}}}}


def test_a_dynamic_reference_the_path_decides_gets_a_copy_per_scope(compiler, tok):
    """Two paths reach one $dynamicRef with different resources in scope (numbers or strings):
    the list schema is copied once per scope, each copy with its own item type."""
    assert_classified(compiler, tok, LISTS, [{"kind": "n", "list": [1, 2.5]}, {"kind": "s", "list": ["a"]}, {}],
                      [{"kind": "n", "list": ["a"]}, {"kind": "s", "list": [1]}, {"list": [2]}])


def test_too_many_dynamic_scopes_are_refused(compiler, monkeypatch):
    from constraints.schema import references

    monkeypatch.setattr(references, "MAX_COPIES", 1)
    with pytest.raises(UnsupportedConstraintError) as info:
        normalise_schema(LISTS)
    assert info.value.keyword == "$dynamicRef" and "/$defs/genericList/properties/list/items" in info.value.message


def test_a_recursive_reference_extends_from_the_outermost_resource():
    """2019-09's ``$recursiveRef: "#"``: the items of the tree schema, reached from a schema that
    also sets ``$recursiveAnchor``, refer to that outer schema (the "strict tree" pattern)."""
    tree = {"$id": "http://x/tree", "$recursiveAnchor": True, "type": "object",
            "properties": {"children": {"type": "array", "items": {"$recursiveRef": "#"}}}}
    strict = {"$schema": "https://json-schema.org/draft/2019-09/schema", "$id": "http://x/strict",
              "$recursiveAnchor": True, "$ref": "tree", "maxProperties": 1, "$defs": {"tree": tree}}
    out = normalise_schema(strict)
    assert out["$defs"]["tree"]["properties"]["children"]["items"] == {"$ref": "#"}
    alone = normalise_schema({"$schema": "https://json-schema.org/draft/2019-09/schema", "$defs": {"tree": tree},
                              "$ref": "http://x/tree"})
    assert alone["$defs"]["tree"]["properties"]["children"]["items"] == {"$ref": "#/$defs/tree"}


def test_remote_and_dangling_references_are_refused(compiler):
    with pytest.raises(UnsupportedConstraintError, match="not a reference into this schema"):
        compiler.compile(ConstraintSpec("json_schema", {"$id": "http://a.org/x", "$ref": "y.json"}))
    with pytest.raises(InvalidConstraintError, match="does not resolve"):
        compiler.compile(ConstraintSpec("json_schema", {"$id": "http://a.org/x", "$ref": "x#missing"}))
