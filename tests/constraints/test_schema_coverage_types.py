"""An ``enum`` beside a ``type`` keeps only the values of that type (constraints/schema/coverage.py):
llguidance does not intersect the two when they meet through a ``$ref`` (MaskBench Github_easy
o20478, once references became pointers and its properties could be reordered)."""

from __future__ import annotations

from constraints import ConstraintSpec
from constraints.schema.analysis import rewrite_schema

from .conftest import walk_json

SCHEMA = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "additionalProperties": False,
          "id": "http://localhost:3000/schemas/refresh.json#", "required": ["grant_type"],
          "properties": {"grant_type": {"enum": ["refresh_token"], "type": "string"},
                         "scope": {"enum": ["openid", "profile"], "type": "array"},
                         "n": {"enum": [1, "a"], "type": "integer"}}}


def test_values_of_another_type_are_dropped():
    props = rewrite_schema(SCHEMA)["properties"]
    assert props["scope"] is False and props["n"] == {"enum": [1]}
    assert props["grant_type"] == {"enum": ["refresh_token"], "type": "string"}


def test_a_property_no_value_fits_is_never_written(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    assert walk_json(compiled, tok, {"grant_type": "refresh_token", "n": 1})
    assert not walk_json(compiled, tok, {"grant_type": "refresh_token", "scope": "openid"})
    assert not walk_json(compiled, tok, {"grant_type": "refresh_token", "n": "a"})
