"""Whether two schemas can accept the same instance, decided conservatively (by their types,
literals, patterns, discriminating properties and closed objects): ``oneOf`` over disjoint
branches is an ``anyOf``."""

from __future__ import annotations

from typing import Any

from ..regex.disjoint import patterns_disjoint
from .keywords import ALL_TYPES, meaningful, type_list
from .tree import resolve

def _literal_values(node: dict) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def possible_types(node: Any, root: dict, depth: int = 0) -> set[str]:
    node = resolve(node, root)
    if node is False:
        return set()
    if not isinstance(node, dict) or depth > 16:
        return set(ALL_TYPES)
    types = set(ALL_TYPES)
    declared = type_list(node.get("type")) if "type" in node else None
    if declared is not None:
        types &= set(declared) | ({"number"} if "integer" in declared else set())
    lits = _literal_values(node)
    if lits is not None:
        types &= set().union(*(_json_types(v) for v in lits)) if lits else set()
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            types &= set().union(*(possible_types(b, root, depth + 1) for b in node[key])) if node[key] else set()
    if isinstance(node.get("allOf"), list):
        for b in node["allOf"]:
            types &= possible_types(b, root, depth + 1)
    if isinstance(node.get("$ref"), str) and len(node) > 1:
        types &= possible_types({"$ref": node["$ref"]}, root, depth + 1)
    return types


def _discriminators(node: Any, root: dict, depth: int = 0) -> dict[str, tuple[list[Any], bool]]:
    """Properties with literal values (const/enum) -> (values, required)."""
    node = resolve(node, root)
    if not isinstance(node, dict) or depth > 8:
        return {}
    out: dict[str, tuple[list[Any], bool]] = {}
    req = set(node.get("required") or [])
    for name, sub in (node.get("properties") or {}).items():
        sub = resolve(sub, root)
        if isinstance(sub, dict):
            lits = _literal_values(sub)
            if lits is not None:
                out[name] = (lits, name in req)
    for part in node.get("allOf") or []:
        for name, (lits, required) in _discriminators(part, root, depth + 1).items():
            if name in out:
                out[name] = (out[name][0], out[name][1] or required)
            else:
                out[name] = (lits, required or name in req)
    return out


def _canon(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _disjoint(a: Any, b: Any, root: dict) -> bool:
    ta, tb = possible_types(a, root), possible_types(b, root)
    if not ta & tb:
        return True
    ra, rb = resolve(a, root), resolve(b, root)
    if isinstance(ra, dict) and isinstance(rb, dict):
        la, lb = _literal_values(ra), _literal_values(rb)
        if la is not None and lb is not None and not ({_canon(v) for v in la} & {_canon(v) for v in lb}):
            return True
        if ta & tb <= {"string"} and _patterns_exclude(ra, rb):
            return True
        if ta & tb <= {"object"}:
            da, db = _discriminators(ra, root), _discriminators(rb, root)
            for name in set(da) & set(db):
                (va, ra_), (vb, rb_) = da[name], db[name]
                if (ra_ or rb_) and not ({_canon(v) for v in va} & {_canon(v) for v in vb}):
                    return True
            if _closed_exclusion(ra, rb, root) or _closed_exclusion(rb, ra, root):
                return True
    return False


def _patterns_exclude(a: dict, b: dict) -> bool:
    """No string matches both patterns (then no string satisfies both schemas)."""
    pa, pb = a.get("pattern"), b.get("pattern")
    if not (isinstance(pa, str) and isinstance(pb, str)):
        return False
    return patterns_disjoint(pa, pb)


def _closed_exclusion(a: dict, b: dict, root: dict) -> bool:
    """a requires a property that b forbids (b closed via additionalProperties: false)."""
    if b.get("additionalProperties") is not False or b.get("patternProperties"):
        return False
    allowed = set((b.get("properties") or {}).keys())
    return any(name not in allowed for name in a.get("required") or [])


OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
     "maxProperties", "dependencies", "dependentRequired", "dependentSchemas", "propertyNames"}
)


def objects_only_disjoint(branches: list[Any], root: dict) -> bool:
    """True when every branch (two or more) constrains objects only, with no ``type``, and no
    object can match two of them: a non-object then matches every branch, so ``oneOf`` means
    "an object matching one branch" (a discriminated union written without ``type``)."""
    typed = []
    for branch in branches:
        if not isinstance(branch, dict) or not set(meaningful(branch)) <= OBJECT_KEYWORDS:
            return False
        typed.append({**branch, "type": "object"})
    return len(typed) >= 2 and pairwise_disjoint(typed, root)


STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "format"})


def strings_only_disjoint(branches: list[Any], root: dict) -> bool:
    """True when every branch (two or more) constrains strings only, with no ``type``, and no
    string can match two of them: a non-string then matches every branch, so ``oneOf`` means
    "a string matching one branch" (``oneOf`` of patterns under ``type: string``)."""
    typed = []
    for branch in branches:
        if not isinstance(branch, dict) or not set(meaningful(branch)) <= STRING_KEYWORDS:
            return False
        typed.append({**branch, "type": "string"})
    return len(typed) >= 2 and pairwise_disjoint(typed, root)


def pairwise_disjoint(branches: list[Any], root: dict) -> bool:
    """True when no instance can match two of the branches (so oneOf == anyOf)."""
    return all(
        _disjoint(branches[i], branches[j], root)
        for i in range(len(branches))
        for j in range(i + 1, len(branches))
    )
