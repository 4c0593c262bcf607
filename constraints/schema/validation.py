"""Checking a value against a subschema with ``jsonschema``, exactly: ``multipleOf`` decided on
exact decimals, references into the root's definitions allowed; and JSON values compared as
JSON Schema compares them. The rewrites use it to test literals and finite domains (:mod:`.coverage`, :mod:`.disjoint`, :mod:`.intersection`,
:mod:`.lark`)."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

from .numbers import multiple_of_keyword
from .tree import subschemas

DEFINITION_KEYS = ("definitions", "$defs")


def instance_validator(schema: Any, root: dict | None = None) -> Callable[[Any], bool] | None:
    """is-valid for a self-contained schema (no ``$ref`` in it or its subschemas; a literal
    ``{"$ref": …}`` inside an ``enum`` or ``const`` is a value, not a reference), else None.
    With ``root``, references into the root's ``definitions`` / ``$defs`` are allowed: the
    schema is checked with those containers copied beside it."""
    import jsonschema

    refs = [sub for _, sub in subschemas(schema) if isinstance(sub, dict)
            and ("$ref" in sub or "$dynamicRef" in sub or "$recursiveRef" in sub)]
    if refs:
        schema = with_root_definitions(schema, root)
        if schema is None:
            return None
    try:
        validator = _exact_validator(jsonschema.validators.validator_for(schema))(schema)
    except Exception:
        return None
    return validator.is_valid


@functools.cache
def _exact_validator(cls: type) -> type:
    """``cls`` deciding ``multipleOf`` on exact decimals."""
    import jsonschema

    return jsonschema.validators.extend(cls, {"multipleOf": multiple_of_keyword})


def with_root_definitions(schema: dict, root: dict | None) -> dict | None:
    """``schema`` with the root's definition containers beside it, when every reference in it
    and in them is ``#/definitions/…`` or ``#/$defs/…`` and no nested ``$id`` moves the base."""
    if root is None or not isinstance(schema, dict):
        return None
    out = dict(schema)
    for key in DEFINITION_KEYS:
        if isinstance(root.get(key), dict) and key not in schema:
            out[key] = root[key]
    for pointer, sub in subschemas(out):
        if not isinstance(sub, dict):
            continue
        if pointer and ("$id" in sub or isinstance(sub.get("id"), str)):
            return None
        if "$dynamicRef" in sub or "$recursiveRef" in sub:
            return None
        ref = sub.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith(("#/definitions/", "#/$defs/"))):
            return None
    return out


def same_value_key(value: Any) -> str:
    """A key two JSON values share exactly when JSON Schema calls them equal (``1`` and
    ``1.0`` alike, ``1`` and ``true`` apart, at any depth)."""
    return json.dumps(_integral(value), sort_keys=True)


def same_json(a: Any, b: Any) -> bool:
    """JSON Schema's equality of two JSON values (see :func:`same_value_key`)."""
    return same_value_key(a) == same_value_key(b)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value
