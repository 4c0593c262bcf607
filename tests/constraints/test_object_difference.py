"""oneOf over object branches that overlap, made exclusive (constraints/schema/object_difference.py):
each branch keeps only the objects that fail every branch it shares objects with, written as
flat copies of it (a discriminator required, a name the other does not list, a value the
other's schema rejects), so instances matching two branches are refused by the mask and those
matching one accepted (MaskBench Github_hard o84383, o27348, o64819, o68391, o90420)."""

from __future__ import annotations

import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.schema.analysis import rewrite_schema
from constraints.schema.object_difference import exclusive_objects
from constraints.schema.tree import subschemas

from .conftest import assert_classified


def _one_of_left(schema: dict) -> bool:
    return any(isinstance(n, dict) and "oneOf" in n for _, n in subschemas(rewrite_schema(schema)))


def _operation(kind: str) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["value"],
            "properties": {"type": {"type": "string", "enum": [kind]}, "value": {"type": "string"}}}


OPTIONAL_DISCRIMINATOR = {"type": "array", "items": {"oneOf": [_operation("exec"), _operation("install")]}}


def test_closed_branches_told_apart_only_by_an_optional_discriminator(compiler, tok):
    """{"value": "a"} matches both (no "type"): refused; with a "type" it matches one."""
    assert not _one_of_left(OPTIONAL_DISCRIMINATOR)
    assert_classified(compiler, tok, OPTIONAL_DISCRIMINATOR,
                      valid=[[{"type": "exec", "value": "a"}], [{"value": "b", "type": "install"}], []],
                      invalid=[[{"value": "a"}], [{"type": "other", "value": "a"}], [{"type": "exec"}],
                               [{"type": "exec", "value": "a", "x": 1}]])


PARTITION = {"type": "object", "properties": {"size": {"type": "integer"}}}
PARTITIONS = {"type": "object", "oneOf": [
    {"type": "object", "additionalProperties": False, "required": ["root"],
     "properties": {"root": PARTITION, "type": {"enum": ["none"]}}},
    {"type": "object", "additionalProperties": False, "required": ["root"],
     "properties": {"boot": PARTITION, "root": PARTITION, "swap": PARTITION, "type": {"enum": ["msdos", "gpt"]}}},
]}


def test_a_closed_branch_with_more_names(compiler, tok):
    """{"root": {}} matches both; the second branch alone takes it with "boot" or "swap"."""
    assert not _one_of_left(PARTITIONS)
    assert_classified(compiler, tok, PARTITIONS,
                      valid=[{"root": {}, "type": "none"}, {"root": {}, "type": "gpt"}, {"root": {}, "boot": {}},
                             {"swap": {"size": 1}, "root": {"size": 2}}],
                      invalid=[{"root": {}}, {"root": {}, "type": "none", "boot": {}}, {"boot": {}},
                               {"root": {}, "boot": {"size": "x"}}, {"root": {}, "type": "dos"}])


EVENT = {"properties": {"type": {"enum": ["repaired"]}, "id": {"type": "string"}}, "required": ["type", "id"]}
DUPLICATED = {"type": "object", "oneOf": [  # 7 branches: more than exactly_one negates
    EVENT, dict(EVENT),
    *({"properties": {"type": {"enum": [kind]}, "id": {"type": "string"}}, "required": ["type", "id"]}
      for kind in ("failed", "active", "inactive", "leak", "fill")),
]}


def test_a_branch_written_twice_keeps_no_object(compiler, tok):
    """Every object of a duplicated branch matches both copies: oneOf refuses it (MaskBench
    Github_hard o64819 lists "pumprepaired" twice among 7 events)."""
    assert not _one_of_left(DUPLICATED)
    assert_classified(compiler, tok, DUPLICATED,
                      valid=[{"type": "failed", "id": "a"}, {"type": "failed", "id": "b", "x": 1}],
                      invalid=[{"type": "repaired", "id": "a"}, {"type": "failed"}, {}, {"type": "other", "id": "a"}])


OPEN_BRANCHES = {"type": "object", "oneOf": [
    {"properties": {"min": {"type": "string"}}},
    {"properties": {"exact": {"type": "string"}}},
]}


def test_open_branches_by_the_negation_of_a_value(compiler, tok):
    """An object without "exact" matches the second branch, so the first takes only objects
    whose "exact" is no string, and the other way round ({} and {"min": "a"} match both)."""
    assert not _one_of_left(OPEN_BRANCHES)
    assert_classified(compiler, tok, OPEN_BRANCHES,
                      valid=[{"min": 1}, {"exact": 2}, {"min": "a", "exact": 3}, {"exact": "a", "min": True}],
                      invalid=[{}, {"min": "a"}, {"exact": "b"}, {"min": 1, "exact": 1}, {"x": 1},
                               {"min": "a", "exact": "b"}, "s"])


def test_a_value_with_no_exact_negation_is_refused(compiler):
    """not {"type": "integer"} has no exact form (numbers that are not integers)."""
    schema = {"type": "object", "oneOf": [{"properties": {"min": {"type": "integer"}}},
                                          {"properties": {"exact": {"type": "integer"}}}]}
    assert exclusive_objects(schema["oneOf"], schema, {"type": "object"}) is None
    with pytest.raises(UnsupportedConstraintError, match="'oneOf'"):
        compiler.compile(ConstraintSpec("json_schema", schema))


def test_branches_that_take_other_types_are_left_alone():
    """A string matches both untyped branches: not a question of objects alone."""
    branches = [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "string"}}}]
    assert exclusive_objects(branches, {}, {}) is None
    assert exclusive_objects([{"type": "object"}, {"type": "string"}, {"minLength": 2}], {}, {}) is None


CLOSED_BESIDE = {"type": "object", "properties": {"extra": {"type": ["boolean", "string"]}}, "oneOf": [
    {"additionalProperties": False, "required": ["a"], "properties": {"a": {"type": "string"}}},
    {"additionalProperties": False, "required": ["a"], "properties": {"a": {"type": "string"}, "extra": {"type": "boolean"}}},
]}


def test_a_closed_branch_takes_no_name_it_does_not_list(compiler, tok):
    """"extra" is listed beside the oneOf, but the first branch is closed without it: a copy
    of that branch must not list it (with a string value it would match no branch)."""
    assert not _one_of_left(CLOSED_BESIDE)
    assert_classified(compiler, tok, CLOSED_BESIDE, valid=[{"extra": True, "a": "s"}],
                      invalid=[{"a": "s"}, {"extra": "x", "a": "s"}, {"a": "s", "extra": "x"}, {"extra": True}])
