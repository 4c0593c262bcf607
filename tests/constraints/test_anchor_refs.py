"""``$ref`` to a plain-name fragment (draft-04 ``id: "#name"``, draft-06/07 ``$id: "#name"``,
``$anchor``) is resolved to the named subschema and enforced (MaskBench Github_medium o35905)."""

from __future__ import annotations

import jsonschema
import pytest

from constraints import ConstraintSpec, InvalidConstraintError
from constraints.schema.analysis import normalise_schema

from .conftest import walk_json

DRAFT4 = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "definitions": {
        "priority": {"id": "#priority", "type": "integer", "minimum": 0},
        "rule": {"id": "#rule", "type": "object", "properties": {"priority": {"$ref": "#priority"}},
                 "required": ["priority"]},
    },
    "type": "object",
    "properties": {"transit": {"$ref": "#rule"}},
    "required": ["transit"],
}
ANCHOR = {
    "$defs": {"name": {"$anchor": "name", "type": "string", "maxLength": 3}},
    "type": "array",
    "items": {"$ref": "#name"},
}


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        (DRAFT4, [{"transit": {"priority": 0}}, {"transit": {"priority": 7}}],
         [{"transit": {"priority": -1}}, {"transit": {}}, {"transit": {"priority": "1"}}, {}]),
        (ANCHOR, [[], ["abc", ""]], [["abcd"], [1]]),
    ],
    ids=["draft4-id", "anchor"],
)
def test_plain_name_refs_are_enforced(compiler, tok, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    validator = jsonschema.validators.validator_for(schema)(schema)
    for value in valid:
        assert validator.is_valid(value) and walk_json(compiled, tok, value), value
    for value in invalid:
        assert not validator.is_valid(value) and not walk_json(compiled, tok, value), value


def test_refs_become_pointers_and_duplicates_stay():
    out = normalise_schema(DRAFT4)
    assert out["properties"]["transit"]["$ref"] == "#/definitions/rule"
    assert out["definitions"]["rule"]["properties"]["priority"]["$ref"] == "#/definitions/priority"
    twice = {"$defs": {"a": {"$anchor": "n"}, "b": {"$anchor": "n"}}, "$ref": "#n"}
    assert normalise_schema(twice)["$ref"] == "#n"


def test_an_unknown_name_is_still_refused(compiler):
    with pytest.raises(InvalidConstraintError, match="#nowhere"):
        compiler.compile(ConstraintSpec("json_schema", {"properties": {"a": {"$ref": "#nowhere"}}}))
