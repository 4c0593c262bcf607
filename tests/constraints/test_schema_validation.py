"""``constraints/schema/validation.py``: JSON values compared as JSON Schema compares them, at
any depth (the uniqueItems and enum rewrites and the disjointness proofs share this one rule)."""

from __future__ import annotations

import pytest

from constraints.schema.validation import instance_validator, same_json, same_value_key


@pytest.mark.parametrize("a,b", [(1, 1.0), ([1, {"x": 2.0}], [1.0, {"x": 2}]), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
                                 (2**60, float(2**60))])
def test_equal_values(a, b) -> None:
    assert same_json(a, b) and same_value_key(a) == same_value_key(b)


@pytest.mark.parametrize("a,b", [(1, True), ([1], [True]), (0, False), (2**60 + 1, float(2**60)), ("1", 1),
                                 ({"a": None}, {})])
def test_unequal_values(a, b) -> None:
    assert not same_json(a, b)


def test_instance_validator_decides_multiple_of_exactly() -> None:
    valid = instance_validator({"type": "number", "multipleOf": 0.1})
    assert valid(0.3) and not valid(0.35)
