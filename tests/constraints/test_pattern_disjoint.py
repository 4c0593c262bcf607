"""oneOf over string patterns (constraints/regex/disjoint.py): branches whose patterns no
string can match together are enforced as anyOf under type string; overlapping ones are still
refused by name (MaskBench Github_hard o2070)."""

from __future__ import annotations

import jsonschema
import pytest

from constraints import ConstraintSpec
from constraints.regex.dialect import ecma_regex
from constraints.regex.disjoint import patterns_disjoint

from .conftest import walk_json


@pytest.mark.parametrize(
    ("a", "b", "disjoint"),
    [
        ("^Normal -", "^Primary tumour -", True),
        ("^[0-9]+$", "^[a-z]+$", True),
        ("^(a|b)$", "^c$", True),
        ("^a.b$", "^a\\nb$", True),  # ECMA "." excludes line terminators
        ("^\\S+$", "^ $", True),
        ("^Normal -", "tumour", False),  # "Normal - tumour" matches both (search semantics)
        ("a", "b", False),
        ("^\\d+$", "^\\w+$", False),
        ("^a.b$", "^a\u00a0b$", False),  # U+00A0 is not a line terminator
        ("^\\s$", "^\u2028$", False),  # ECMA \s includes U+2028
        ("^a|b", "^c", False),  # an anchor on one alternative only: not decided
        ("^(?=a)", "^b", False),  # lookaround: not decided
    ],
)
def test_patterns_disjoint(a, b, disjoint):
    assert patterns_disjoint(ecma_regex(a), ecma_regex(b)) is disjoint


SPECIMEN = {
    "type": "string",
    "oneOf": [{"pattern": "^Normal -"}, {"pattern": "^Primary tumour -"}, {"pattern": "^Cell line -"}],
}


def test_one_of_disjoint_patterns_is_enforced(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", SPECIMEN))
    for value in ["Normal - blood", "Primary tumour - x", "Cell line -"]:
        jsonschema.validate(value, SPECIMEN)
        assert walk_json(compiled, tok, value), value
    for value in ["normal - blood", "Tumour", "", 3, None]:
        assert not jsonschema.Draft202012Validator(SPECIMEN).is_valid(value)
        assert not walk_json(compiled, tok, value), value


def test_without_type_a_non_string_matches_every_branch():
    """oneOf of patterns alone: a number matches every branch, so only strings are valid."""
    from constraints.schema.analysis import rewrite_schema

    schema = {"oneOf": SPECIMEN["oneOf"]}
    out = rewrite_schema(schema)
    for value in ["Normal - a", "Cell line - b", 3, None, "other"]:
        assert jsonschema.Draft202012Validator(out).is_valid(value) == \
            jsonschema.Draft202012Validator(schema).is_valid(value)


def test_overlapping_patterns_are_not_taken_as_exclusive():
    """"0000" matches both: oneOf is not anyOf here (refused, or enforced by negation)."""
    from constraints.schema.disjoint import strings_only_disjoint

    branches = [{"pattern": "^[0-9a-f]{4}$"}, {"pattern": "^[0-9A-F]{4}$"}]
    assert not strings_only_disjoint(branches, {})
    assert strings_only_disjoint([{"pattern": "^[a-f]{4}$"}, {"pattern": "^[A-F]{4}$"}], {})
