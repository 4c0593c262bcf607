"""``anyOf`` branches no instance can take, dropped because of their types.

An instance of a node satisfies every conjunct of it at once: the node's own keywords, its
``allOf`` members (nested ``allOf`` s too) and, for the value of a property ``p``, every
``properties[p]`` those conjuncts list. A branch of an ``anyOf`` among them whose possible types
(:func:`constraints.schema.disjoint.possible_types`, which only ever widens them) share none with
the types those conjuncts allow together is taken by no instance, and dropping it changes
nothing. The rewrites leave such branches behind: ``oneOf`` made exclusive conjoins a branch with
the negation of another, and the negation of ``{"events": {"type": "array", "items": X}}`` has a
branch ``{"type": "array", "contains": not X}`` for ``events`` even where the branch's own
``events`` is a string; a ``contains`` under a property has no exact form here (it is refused by
name), while the string-only conjunction it sits in needs none (MaskBench JsonSchemaStore
grunt-watch-task, packer, sounds, ...).

A branch is dropped only when another one stays: an ``anyOf`` none of whose branches fits is
left as it is (the node has no instance; the other rewrites and the backends say so).
"""

from __future__ import annotations

import json
from typing import Any

from .disjoint import possible_types
from .tree import subschemas

MAX_NODES = 20_000  # subschemas looked at in one schema; beyond, the schema is left as it is


def prune_typed_branches(schema: Any) -> Any:
    """``schema`` (a rewritten schema; an unshared copy is returned when anything changes) with
    the ``anyOf`` branches its conjuncts' types rule out dropped."""
    if not isinstance(schema, dict):
        return schema
    out = json.loads(json.dumps(schema))  # rewrites share subschemas: prune each place alone
    nodes = [n for _, n in subschemas(out) if isinstance(n, dict)]
    if len(nodes) > MAX_NODES:
        return schema
    changed = False
    for node in nodes:
        changed |= _prune_node(node, out)
    return out if changed else schema


def _prune_node(node: dict, root: dict) -> bool:
    """Prune ``node``'s conjuncts against the node's types, and the schemas its conjuncts give
    one property against each other."""
    parts = _conjuncts(node)
    if len(parts) < 2 and "anyOf" not in node:
        return False
    changed = False
    allowed = possible_types(node, root)
    if allowed:
        for part in parts:
            changed |= _prune_any_of(part, allowed, root)
    for values in _property_values(parts).values():
        if len(values) < 2:
            continue
        allowed = possible_types({"allOf": values}, root)
        if not allowed:
            continue
        for value in values:
            for part in _conjuncts(value):
                changed |= _prune_any_of(part, allowed, root)
    return changed


def _conjuncts(node: Any) -> list[dict]:
    """``node`` and its ``allOf`` members, nested ones too (no ``$ref`` followed: a reference
    target serves other places as well)."""
    out: list[dict] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, dict) or any(current is seen for seen in out):
            continue
        out.append(current)
        members = current.get("allOf")
        if isinstance(members, list):
            stack.extend(reversed(members))
    return out


def _property_values(parts: list[dict]) -> dict[str, list[Any]]:
    """Property name -> the schemas the parts give its value."""
    values: dict[str, list[Any]] = {}
    for part in parts:
        props = part.get("properties")
        if isinstance(props, dict):
            for name, value in props.items():
                values.setdefault(name, []).append(value)
    return values


def _prune_any_of(part: dict, allowed: set[str], root: dict) -> bool:
    """Drop ``part``'s ``anyOf`` branches of none of the ``allowed`` types (one must stay)."""
    branches = part.get("anyOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return False
    kept = [b for b in branches if possible_types(b, root) & allowed]
    if not kept or len(kept) == len(branches):
        return False
    part["anyOf"] = kept
    return True
