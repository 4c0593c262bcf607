"""``propertyNames`` beside ``patternProperties``, folded into the object's keys exactly.

Every key must be a name ``propertyNames`` allows. Where those names are listed (an ``enum`` /
``const``), each becomes a listed property with the subschemas it would have met: its own
``properties`` entry, those of the patterns it matches, ``additionalProperties`` when it is
neither listed nor matched; the object then takes no other key. Where they are a lone
``pattern``, each pattern of ``patternProperties`` is narrowed to the keys the name pattern
also matches (:func:`constraints.regex.regions.intersect_patterns`) and, unless the object is
closed, the names no pattern takes get a pattern of their own with the ``additionalProperties``
subschema (which must say nothing where properties are listed). Listed properties keep their subschema
when their name is allowed and become false otherwise. Anything else is left as it is (None).
"""

from __future__ import annotations

from typing import Any, Callable

from ..regex.disjoint import patterns_disjoint
from ..regex.regions import intersect_patterns, pattern_matches, subtract_patterns
from .keywords import type_list
from .negation import all_of
from .tree import resolve

# what a name schema may say beside its pattern (annotations; type only as "string")
_NOTES = frozenset({"type", "title", "description", "$comment", "examples"})
MAX_NAME_BRANCHES = 8


def names_beside_patterns(node: dict, valid: Callable[[str], bool], names: list[str] | None,
                          name_pattern: str | None) -> dict | None:
    """``node`` (with ``patternProperties``) without its ``propertyNames`` and meaning the same,
    given the name schema as a predicate (``valid``) and as listed ``names`` or a lone
    ``name_pattern``; None where that has no form here."""
    patterns, props = node.get("patternProperties"), node.get("properties", {})
    extra = node.get("additionalProperties", True)
    if not isinstance(patterns, dict) or not isinstance(props, dict) or not isinstance(extra, (bool, dict)):
        return None
    if names is not None:
        listed = _listed(props, patterns, extra, names, valid)
        if listed is None:
            return None
        out = {k: v for k, v in node.items() if k not in ("propertyNames", "patternProperties")}
        return {**out, "properties": listed, "additionalProperties": False}
    if name_pattern is None or (extra is not False and props and extra not in (True, {})):
        return None  # (a listed name the open part's pattern takes would meet its schema too)
    narrowed = _narrowed(patterns, name_pattern)
    if narrowed is None:
        return None
    if extra is not False:  # the allowed names no pattern takes: additionalProperties' keys
        rest = subtract_patterns(name_pattern, list(patterns))
        if rest is None:
            return None
        if rest is not False:
            narrowed[name_pattern if rest is True else rest] = extra
    out = {k: v for k, v in node.items() if k != "propertyNames"}
    if props:
        out["properties"] = {k: (v if valid(k) else False) for k, v in props.items()}
    out["patternProperties"] = narrowed
    out["additionalProperties"] = False
    return out


def _listed(props: dict, patterns: dict, extra: Any, names: list[str],
            valid: Callable[[str], bool]) -> dict | None:
    """Every allowed name as a listed property with the subschemas it meets (None: a pattern
    with no DFA here)."""
    out = {k: (v if valid(k) else False) for k, v in props.items()}
    for name in [*props, *(n for n in names if n not in props)]:
        if out.get(name) is False:
            continue
        matched = [pattern_matches(p, name) for p in patterns]
        if any(m is None for m in matched):
            return None
        parts = [s for s, m in zip(patterns.values(), matched) if m]
        own = [props[name]] if name in props else [] if parts else [extra]
        out[name] = all_of([*own, *parts])
    return out


def _narrowed(patterns: dict, name_pattern: str) -> dict | None:
    """``patterns`` each narrowed to the keys ``name_pattern`` matches (None: one cannot be)."""
    out = {}
    for pattern, schema in patterns.items():
        both = intersect_patterns(pattern, name_pattern)
        if both is None:
            return None
        if both is True:
            out[pattern] = schema
        elif both is not False:
            out[both] = schema
    return out



def name_pattern(names: Any, root: dict) -> str | None:
    """A pattern matching exactly the strings ``names`` accepts (names are strings, so branches
    of other types drop out): a lone ``pattern``, an ``allOf`` of one, an ``anyOf`` of such
    (the union of their patterns) or a ``oneOf`` of such whose strings are disjoint, through
    ``$ref``; None for anything else."""
    parts = _string_patterns(names, root, 0)
    return "|".join(parts) if parts else None


def _string_patterns(names: Any, root: dict, depth: int) -> list[str] | None:
    """The patterns whose union is the strings ``names`` accepts ([]: none), or None."""
    node = resolve(names, root)
    if not isinstance(node, dict) or depth > 8:
        return None
    types = type_list(node["type"]) if "type" in node else ["string"]
    if types is None:
        return None
    if "string" not in types:
        return []  # whatever else it says, no string satisfies it
    rest = set(node) - _NOTES
    if rest == {"pattern"} and isinstance(node["pattern"], str):
        return [node["pattern"]]
    if rest == {"allOf"} and isinstance(node["allOf"], list) and len(node["allOf"]) == 1:
        return _string_patterns(node["allOf"][0], root, depth + 1)
    key = next(iter(rest)) if len(rest) == 1 else None
    branches = node.get(key) if key in ("anyOf", "oneOf") else None
    if not isinstance(branches, list) or not 0 < len(branches) <= MAX_NAME_BRANCHES:
        return None
    parts = [_string_patterns(b, root, depth + 1) for b in branches]
    if any(p is None for p in parts):
        return None
    if key == "oneOf" and not all(patterns_disjoint(a, b) for i, p in enumerate(parts) for q in parts[i + 1:]
                                  for a in p for b in q):
        return None  # a string two branches take is no name: not a union
    return [q for p in parts for q in p]
