"""Exact rewrites of keywords the backends do not enforce into forms they do.

Each rewrite applies only where the result means exactly the same set of instances and stays
small; otherwise the node is left as it was (and strict mode refuses the keyword by name).

* ``uniqueItems`` over a finite item domain (``enum`` / ``const`` / boolean items): the arrays of
  distinct values, enumerated, when there are at most :data:`MAX_ENUMERATED` of them;
* ``contains`` (with ``minContains`` / ``maxContains``) on arrays of at most
  :data:`MAX_CONTAINS_ITEMS` items whose ``contains`` schema can be negated: one ``prefixItems``
  branch per placement of matching and non-matching items;
* ``minProperties`` / ``maxProperties`` over closed ``properties``: one branch per allowed set of
  optional properties;
* ``propertyNames`` as a key enumeration (``enum`` / ``const``) or a ``pattern``: closed
  ``properties`` / ``patternProperties`` with ``additionalProperties: false``.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any, Callable

from ..regex.analysis import finite_strings
from .named_patterns import name_pattern, names_beside_patterns
from .numbers import exact, json_number
from .tree import conjoin, names_draft, resolve, subschemas
from .validation import DEFINITION_KEYS, instance_validator, same_json

MAX_ENUMERATED = 128  # arrays a uniqueItems rewrite may list
MAX_CONTAINS_ITEMS = 5  # longest array a contains rewrite spells out position by position
_NAME_KEYS = frozenset({"type", "title", "description", "$comment", "examples"})


def rewrite_coverage(node: dict, root: dict, negate: Callable[[Any, dict], Any]) -> Any:
    """``node`` with the rewritable keywords above replaced (node | False)."""
    node = _bounded_multiples(node, root)
    if not isinstance(node, dict):
        return node
    node = _finite_domain(node, root)
    if not isinstance(node, dict):
        return node
    for step in (_unique_items, lambda n: _property_names(n, root), _property_count):
        node = step(node)
        if node is False:
            return False
    return _contains(node, root, negate)


# keywords every backend enforces beside an enum: a node with only these needs no filtering
_PLAIN_ENUM_KEYS = frozenset({"enum", "const", "type", "$schema", "$id", "id", "definitions", "$defs"}) | _NAME_KEYS


def _finite_domain(node: dict, root: dict) -> Any:
    """A node whose instances are among a few listed values (its ``enum`` / ``const``, or those
    of an ``allOf`` member) becomes the enum of the values that satisfy the whole node, checked
    with jsonschema; whatever else the node says (``not``, ``multipleOf``, …) is then enforced
    exactly. Left alone when the node holds a ``$ref`` or a ``format``, or has too many values."""
    values = _listed_values(node, root)
    if values is None or len(values) > MAX_ENUMERATED:
        return node
    if not set(node) - _PLAIN_ENUM_KEYS and _of_type(values, node.get("type")):
        return node
    if any(isinstance(sub, dict) and "format" in sub for _, sub in subschemas(node)):
        return node
    return _enum_of_valid(node, root, values)


def _of_type(values: list[Any], types: Any) -> bool:
    """Whether every value is of ``types`` (absent: any). llguidance does not intersect an
    ``enum`` with the ``type`` beside it when the two meet through a ``$ref`` (MaskBench
    Github_easy o20478 generated ``"scope": "openid"`` for ``{"enum": ["openid"], "type": "array"}``)."""
    if types is None:
        return True
    valid = instance_validator({"type": types})
    return valid is not None and all(valid(v) for v in values)


def _enum_of_valid(node: dict, root: dict, candidates: Any) -> Any:
    """The node as the ``enum`` of the ``candidates`` that satisfy it (checked with jsonschema;
    duplicates dropped), ``False`` when none does, or the node unchanged when it cannot be
    checked or more than :data:`MAX_ENUMERATED` candidates pass."""
    draft = root.get("$schema") if isinstance(root.get("$schema"), str) else None
    valid = instance_validator({**node, "$schema": draft} if draft and "$schema" not in node else node, root)
    if valid is None:
        return node
    kept: list[Any] = []
    try:
        for value in candidates:
            if valid(value) and not any(same_json(value, seen) for seen in kept):
                kept.append(value)
                if len(kept) > MAX_ENUMERATED:
                    return node
    except Exception:  # e.g. an overflow in multipleOf: leave the node to the backends
        return node
    if not kept:
        return False
    return {k: node[k] for k in node if k in DEFINITION_KEYS} | {"enum": kept}


MAX_CANDIDATES = 20_000  # multiples a bounded number node may test one by one
_NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})


def _bounded_multiples(node: dict, root: dict) -> Any:
    """A number node bounded on both sides with a ``multipleOf`` (an integer node: of 1) has
    finitely many instances:
    when there are at most :data:`MAX_CANDIDATES` multiples in range, each is checked against
    the whole node with jsonschema, and the node becomes the ``enum`` of those that pass (at most
    :data:`MAX_ENUMERATED`), so what it says beside (``not``, other ``multipleOf``s, ``oneOf``
    over numbers, …) is enforced exactly. The multiples are computed on the exact decimals
    (:mod:`.numbers`); integral values are written as integers."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or not set(types) <= {"integer", "number"}:
        return node
    parts = [node, *(b for b in node.get("allOf", []) if isinstance(b, dict))]
    lo = _bound(parts, ("minimum", "exclusiveMinimum"), max)
    hi = _bound(parts, ("maximum", "exclusiveMaximum"), min)
    steps = [s for p in parts if (s := exact(p.get("multipleOf"))) is not None and s > 0]
    if not steps and types == ["integer"] and ("not" in node or "oneOf" in node):
        steps = [Fraction(1)]  # integers are the multiples of 1 (a not / oneOf left: enumerate them)
    if lo is None or hi is None or not steps or not set(node) - _NUMBER_KEYS - {"type"} - _NAME_KEYS \
            and len(steps) == 1 and "allOf" not in node:
        return node  # nothing beside the bounds and one step: the backends enforce it already
    step = max(steps)
    first, last = math.ceil(lo / step), math.floor(hi / step)
    if last - first + 1 > MAX_CANDIDATES:
        return node
    multiples = [json_number(k * step) for k in range(first, last + 1)]
    if any(v is None for v in multiples):
        return node  # a multiple no double spells exactly: left to the backends
    return _enum_of_valid(node, root, multiples)


def _bound(parts: list[dict], keys: tuple[str, str], pick: Callable[..., Fraction]) -> Fraction | None:
    """The tightest (inclusive or exclusive: both only narrow the candidates) bound, or None."""
    values = [v for p in parts for k in keys if (v := exact(p.get(k))) is not None]
    return pick(values) if values else None


def _listed_values(node: dict, root: dict) -> list[Any] | None:
    """The values ``node`` can take when they are listed: its ``enum`` / ``const``, an
    ``allOf`` member's, or the union over ``anyOf`` / ``oneOf`` branches that each list theirs."""
    for part in (node, *(b for b in node.get("allOf", []) if isinstance(b, dict))):
        if "const" in part:
            return [part["const"]]
        if isinstance(part.get("enum"), list):
            return list(part["enum"])
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or not branches:
            continue
        union: list[Any] = []
        for branch in branches:
            branch = resolve(branch, root)
            if branch is False:
                continue
            listed = _listed_values(branch, root) if isinstance(branch, dict) else None
            if listed is None:
                break
            union.extend(listed)
        else:
            return union
    return None


def _domain(items: Any) -> list[Any] | None:
    """The finite set of values ``items`` allows, or None."""
    if not isinstance(items, dict):
        return None
    if "const" in items:
        values = [items["const"]]
    elif isinstance(items.get("enum"), list):
        values = list(items["enum"])
    elif items.get("type") == "boolean":
        values = [False, True]
    elif items.get("type") == "null":
        values = [None]
    else:
        return None
    valid = instance_validator(items)
    if valid is None:
        return None
    out: list[Any] = []
    for v in values:
        if valid(v) and not any(same_json(v, w) for w in out):
            out.append(v)
    return out


def _unique_items(node: dict) -> Any:
    if node.get("uniqueItems") is not True or "prefixItems" in node or "contains" in node:
        return node
    domain = _domain(node.get("items"))
    lo, hi = node.get("minItems", 0), node.get("maxItems")
    if domain is None or not isinstance(lo, int):
        return node
    hi = len(domain) if not isinstance(hi, int) else min(hi, len(domain))
    count = sum(math.perm(len(domain), k) for k in range(lo, hi + 1))
    if count > MAX_ENUMERATED:
        return node
    if count == 0:
        return False
    arrays = [list(p) for k in range(lo, hi + 1) for p in itertools.permutations(domain, k)]
    return _and(node, {"enum": arrays}, ("uniqueItems",))


def _contains(node: dict, root: dict, negate: Callable[[Any, dict], Any]) -> Any:
    if "contains" not in node or "prefixItems" in node or isinstance(node.get("items"), list):
        return node
    low, high = node.get("minContains", 1), node.get("maxContains")
    lo, hi = node.get("minItems", 0), node.get("maxItems")
    if not all(isinstance(v, int) for v in (low, lo, hi)) or hi > MAX_CONTAINS_ITEMS:
        return node
    match = node["contains"]
    miss = negate(match, root)
    if miss is None:
        return node
    high = hi if not isinstance(high, int) else high
    branches = []
    for k in range(lo, hi + 1):
        for hits in range(low, min(high, k) + 1):
            for where in itertools.combinations(range(k), hits):
                prefix = [match if i in where else miss for i in range(k)]
                if not any(p is False for p in prefix):
                    branches.append({_positional(root): prefix, "minItems": k, "maxItems": k})
    return _and(node, {"anyOf": branches} if branches else False, ("contains", "minContains", "maxContains"))


def _positional(root: dict) -> str:
    """The keyword for per-position item schemas in ``root``'s draft: drafts before 2020-12 know
    no ``prefixItems`` (llguidance then ignores it) and write them as an ``items`` array."""
    legacy = names_draft(root, ("draft-03", "draft-04", "draft-06", "draft-07", "2019-09"))
    return "items" if legacy else "prefixItems"


def _property_names(node: dict, root: dict) -> Any:
    """``propertyNames`` as closed ``properties`` (an ``enum`` / ``const`` of names) or as a
    ``patternProperties`` pattern (a lone ``pattern``, possibly behind a ``$ref``) with
    ``additionalProperties: false``. The pattern takes the ``additionalProperties`` schema
    (unlisted names get it there), so a listed name the pattern matches is left alone unless
    that schema says nothing."""
    names = resolve(node.get("propertyNames"), root)
    if not isinstance(names, dict):
        return node
    extra = node.get("additionalProperties", True)
    props = node.get("properties", {})
    if not isinstance(props, dict) or not isinstance(extra, (bool, dict)):
        return node
    valid = instance_validator(names, root)
    if valid is None:
        return node
    keys = _name_values(names)
    pattern = name_pattern(names, root) if keys is None else None
    if "patternProperties" in node:
        return names_beside_patterns(node, valid, keys, pattern) or node
    if keys is not None:
        props = {**props, **{k: extra for k in keys if k not in props}}
    elif pattern is not None:
        if extra not in (True, {}, False) and any(valid(k) for k in props):
            return node  # a listed name would take the pattern's schema too
        if extra is not False:  # (closed: the unlisted names are refused already)
            node["patternProperties"] = {pattern: {} if extra is True else extra}
    else:
        return node
    node["properties"] = {k: (v if valid(k) else False) for k, v in props.items()}
    node["additionalProperties"] = False
    node.pop("propertyNames")
    return node


def _property_count(node: dict) -> Any:
    """min/maxProperties over a closed set of properties: one branch per allowed choice of the
    optional ones (llguidance enforces the counts only when every property is required).
    With a minimum, ``patternProperties`` whose patterns each match a few known names count as
    listed."""
    if "minProperties" not in node and "maxProperties" not in node:
        return node
    if "minProperties" in node:  # a maximum alone is met by repeats too: left to llguidance
        node = _named_pattern_properties(node)
    props, required = node.get("properties", {}), node.get("required", [])
    if node.get("additionalProperties") is not False or "patternProperties" in node or not isinstance(props, dict):
        return node
    if not isinstance(required, list) or set(required) - set(props):
        return node
    optional = [k for k in props if k not in required]
    lo, hi = node.get("minProperties", 0), node.get("maxProperties", len(props))
    if not isinstance(lo, int) or not isinstance(hi, int):
        return node
    counts = range(max(lo - len(required), 0), min(hi - len(required), len(optional)) + 1)
    if sum(math.comb(len(optional), j) for j in counts) > MAX_ENUMERATED:
        return node
    branches = [
        {"required": [*required, *chosen], "properties": {k: False for k in optional if k not in chosen}}
        for j in counts for chosen in itertools.combinations(optional, j)
    ]
    return _and(node, {"anyOf": branches} if branches else False, ("minProperties", "maxProperties"))


def _named_pattern_properties(node: dict) -> dict:
    """A closed object's ``patternProperties`` as ``properties`` when every pattern matches a few
    known names (``^[a-d]$``): each name gets its listed schema and every matching pattern's.
    Listed names are what llguidance counts without repeats (it takes a pattern-matched key
    twice, and a count met only by a repeat parses to an object that fails it)."""
    patterns, props = node.get("patternProperties"), node.get("properties", {})
    if not isinstance(patterns, dict) or not isinstance(props, dict) or node.get("additionalProperties") is not False:
        return node
    named = {}
    for pattern, schema in patterns.items():
        names = finite_strings(pattern) if isinstance(pattern, str) else None
        if names is None:
            return node
        for name in names:
            named.setdefault(name, []).append(schema)
    merged = dict(props)
    for name, schemas in named.items():
        parts = ([props[name]] if name in props else []) + schemas
        merged[name] = parts[0] if len(parts) == 1 else {"allOf": parts}
    out = {k: v for k, v in node.items() if k != "patternProperties"}
    out["properties"] = merged
    return out


def _name_values(names: dict) -> list[str] | None:
    """The key names an ``enum`` / ``const`` propertyNames allows (strings only), or None."""
    if set(names) - _NAME_KEYS - {"enum", "const"}:
        return None
    if "const" in names:
        values = [names["const"]]
    elif isinstance(names.get("enum"), list):
        values = names["enum"]
    else:
        return None
    return [v for v in values if isinstance(v, str)]


def _and(node: dict, extra: Any, replacing: tuple[str, ...]) -> Any:
    """``node`` and ``extra``, in the place of the keywords ``extra`` replaces (see
    :func:`constraints.schema.tree.conjoin`)."""
    return conjoin(node, extra, replacing)
