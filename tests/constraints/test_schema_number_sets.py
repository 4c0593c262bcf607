"""Schemas of numbers alone solved as sets (constraints/schema/number_sets.py): ``not`` over
``multipleOf`` and bounds written back as plain pieces, exactly, or left to be refused."""

from __future__ import annotations

from fractions import Fraction

import jsonschema
import pytest

from constraints import ConstraintSpec, EmptyLanguageError, UnsupportedConstraintError
from constraints.schema.number_sets import numbers_only

from .conftest import walk_json

# MaskBench Handwritten allany1: multiples of 5 that are multiples of 7 when of 5, of 11 when of 7
CHAINED = {"type": "number", "allOf": [
    {"minimum": 1}, {"anyOf": [{"multipleOf": 5}, {"multipleOf": 10}]},
    {"anyOf": [{"not": {"multipleOf": 5}}, {"multipleOf": 7}]},
    {"anyOf": [{"not": {"multipleOf": 7}}, {"multipleOf": 11}]}]}
FEW = {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10, "not": {"multipleOf": 3}}
ABOVE = {"type": "number", "not": {"maximum": 5}}
QUARTERS = {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.25, "not": {"multipleOf": 0.5}}
VALUES = [*range(-40, 800, 1), *(Fraction(n, 4) for n in range(-20, 20)), Fraction(77, 10), 385, 770, 1155]


@pytest.mark.parametrize("schema", [CHAINED, FEW, ABOVE, QUARTERS], ids=["chained", "few", "above", "quarters"])
def test_a_number_formula_is_solved_exactly(compiler, tok, schema):
    """Every value is walked to the end exactly when jsonschema calls it valid."""
    assert numbers_only(schema) is not None
    check = jsonschema.validators.validator_for(schema)(schema).is_valid
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, {"json_numbers": "any"}))
    for value in VALUES:
        number = int(value) if value == int(value) else float(value)
        assert walk_json(compiled, tok, number) == check(number), number


def test_the_pieces_are_plain():
    assert numbers_only(CHAINED) == {"anyOf": [{"type": "integer", "multipleOf": 385, "exclusiveMinimum": 1}]}
    assert numbers_only(FEW) == {"anyOf": [{"enum": [-8, -7, -5, -4, -2, -1, 1, 2, 4, 5, 7, 8]}]}
    assert numbers_only(ABOVE) == {"anyOf": [{"type": "number", "exclusiveMinimum": 5}]}
    assert numbers_only(QUARTERS) == {"anyOf": [{"enum": [0.25, 0.75, 1.25, 1.75]}]}
    # integers past 2.5 are integers past 2: an integral bound, exact for every backend
    above = {"type": "number", "exclusiveMinimum": 2.5, "not": {"not": {"multipleOf": 3}}}
    assert numbers_only(above) == {"anyOf": [{"type": "integer", "multipleOf": 3, "exclusiveMinimum": 2}]}


@pytest.mark.parametrize("schema", [
    {"type": "number", "multipleOf": 5, "minimum": 1},  # nothing negated: the backends take it as it is
    {"type": ["number", "string"], "not": {"multipleOf": 5}},  # not numbers alone
    {"type": "number", "not": {"multipleOf": 5}},  # every non-integer in, some integers out: no plain form
    {"type": "number", "not": {"$dynamicRef": "#x"}},  # a keyword this module does not read
])
def test_other_schemas_are_left_alone(schema):
    assert numbers_only(schema) is None


def test_a_set_with_no_plain_form_is_still_refused_by_name(compiler):
    """Non-integers and the integers off a residue class: no piece the backends take."""
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", {"type": "number", "not": {"multipleOf": 5}}))
    assert info.value.keyword == "not"


def test_an_empty_set_is_a_clear_error(compiler):
    schema = {"type": "integer", "minimum": 1, "maximum": 3, "not": {"enum": [1, 2, 3]}}
    with pytest.raises(EmptyLanguageError):
        compiler.compile(ConstraintSpec("json_schema", schema))
