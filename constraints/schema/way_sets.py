"""The ways an object of one ``oneOf`` branch fails the branches it overlaps
(:mod:`.object_difference`), combined: one way per overlapped branch, in as few sets as cover
them all, and the ways in a set that speak of the same property's value merged into one
negation where the schemas they negate list literals (``state`` outside nine lists of codes is
one complement, not nine intersected)."""

from __future__ import annotations

import json
from typing import Any

from .keywords import ANNOTATIONS
from .negation import negate
from .tree import resolve
from .validation import same_value_key


def _key(way: dict) -> str:
    return json.dumps(way, sort_keys=True)


def minimal_combinations(ways: list[list[dict]], limit: int) -> list[list[dict]] | None:
    """The ways to fail every overlapping branch at once: one way from each list, as the
    fewest sets that cover them all. A way that fails several branches (the same schema in
    several lists) is written once, and a set holding another is dropped (its objects are
    among the other's), so "value too long, or ``state`` outside each list" stays two copies
    instead of 2^9. None past ``limit`` sets."""
    keyed = [{_key(w): w for w in options} for options in ways]
    sets: list[frozenset[str]] = [frozenset()]
    for options in keyed:
        grown: set[frozenset[str]] = set()
        for chosen in sets:
            if chosen & options.keys():
                grown.add(chosen)  # it fails this branch already
            else:
                grown.update(chosen | {k} for k in options)
        sets = sorted((s for s in grown if not any(t < s for t in grown)), key=sorted)  # a stable order
        if len(sets) > limit:
            return None
    every = {k: w for options in keyed for k, w in options.items()}
    return [[every[k] for k in sorted(s)] for s in sets]


def value_sources(ways: list[list[dict]], overlapped: list[dict]) -> dict[str, Any]:
    """For each "has ``k`` with a value the other branch rejects" way, the schema it negates:
    ``overlapped[n]``'s ``properties`` entry for ``k`` (``ways[n]`` lists the ways to fail it)."""
    out: dict[str, Any] = {}
    for options, other in zip(ways, overlapped):
        for way in options:
            name = _value_name(way)
            if name is not None and name in other.get("properties", {}):
                out[_key(way)] = other["properties"][name]
    return out


def _value_name(way: dict) -> str | None:
    """The property a bad-value way speaks of (``required`` it, with a schema for its value)."""
    props = way.get("properties", {})
    if way.get("required") and len(props) == 1:
        name = next(iter(props))
        if props[name] is not False and way["required"] == [name]:
            return name
    return None


def merged_values(combo: list[dict], sources: dict[str, Any], root: dict) -> list[dict]:
    """``combo`` with the bad-value ways on one property merged into one where every schema
    they negate lists literals under the same other keywords: not S1 and not S2 is not (S1 or
    S2), whose literals are the union. Other ways are kept as they are."""
    groups: dict[str, list[dict]] = {}
    out: list[dict] = []
    for way in combo:
        name = _value_name(way)
        if name is not None and _key(way) in sources:
            groups.setdefault(name, []).append(way)
        else:
            out.append(way)
    for name, group in groups.items():
        union = _literal_union([sources[_key(w)] for w in group], root) if len(group) > 1 else None
        neg = None if union is None else negate(union, root)
        if neg is None or neg is False:
            out.extend(group)
        else:
            out.append({"required": [name], "properties": {name: neg}})
    return out


def _literal_union(schemas: list[Any], root: dict) -> dict | None:
    """One schema accepting what any of ``schemas`` does, when each is ``enum`` / ``const``
    beside the same other keywords; else None."""
    rest: str | None = None
    values: list[Any] = []
    for schema in schemas:
        node = resolve(schema, root)
        if not isinstance(node, dict):
            return None
        said = {k: v for k, v in node.items() if k not in ANNOTATIONS}
        listed = [said.pop("const")] if "const" in said else said.pop("enum", None)
        if not isinstance(listed, list) or "enum" in said or "const" in said:
            return None
        others = json.dumps(said, sort_keys=True)
        if rest is not None and others != rest:
            return None
        rest = others
        values.extend(listed)
    unique = {same_value_key(v): v for v in values}
    return {**json.loads(rest or "{}"), "enum": list(unique.values())}

