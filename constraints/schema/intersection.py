"""Intersections of subschemas computed before a backend sees the schema.

Where one instance must satisfy two schemas at once (a listed property whose name a
``patternProperties`` pattern also matches; ``type`` beside ``anyOf`` / ``$ref``), llguidance
intersects the two itself while it compiles, and it cannot when one side reaches a ``$ref`` it
is still compiling: it refuses with "circular references with sibling keys". Recursive document
formats (MaskBench's WashingtonPost ANS schemas: a story holds related content, which holds
stories) are refused that way. Two exact rewrites leave nothing of the kind to intersect:

* ``type`` beside ``anyOf`` / ``oneOf`` / ``allOf`` / ``$ref`` is dropped when those admit
  only values of the listed types anyway;
* a ``patternProperties`` pattern that matches every name (``^[a-z]*`` or ``.*``: JSON Schema
  patterns match anywhere in the name) is narrowed to every name but the listed ones, and each
  listed property's schema becomes its intersection with the pattern's schema, computed here.
  The intersection of two schemas one of which is a ``$ref`` becomes a new definition, which
  later intersections of the same pair reuse: that extra indirection is what ends recursion.

Where an intersection cannot be written exactly (two different ``pattern``s, keywords whose
meaning depends on siblings not merged here, ...) the object is left as it was.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from ..regex.dialect import ecma_regex
from ..regex.disjoint import pattern_language
from .disjoint import possible_types
from .keywords import ANNOTATIONS, SPEC_KEYWORDS, type_list
from .negation import complement_regex
from .validation import instance_validator
from .tree import resolve, subschemas

MAX_STEPS = 20_000  # intersection steps for one node; beyond, the node is left alone
DEFS_PREFIX = "trellis-and-"

_APPLICATORS = ("anyOf", "oneOf", "allOf", "$ref")
_LOWER_BOUNDS = ("minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maxLength", "maxItems", "maxProperties")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties")
# keywords that hold on their own (whatever their siblings say): kept from either side
_SAME_OR_ONE = ("pattern", "format", "multipleOf")
_MERGED = frozenset(
    {"type", "properties", "additionalProperties", "required", "items", "uniqueItems", "enum", "const",
     "patternProperties", *_LOWER_BOUNDS, *_UPPER_BOUNDS, *_NUMBER_BOUNDS, *_SAME_OR_ONE}
)


# the keywords of drafts 3 to 2020-12 that constrain instances
_KEYWORDS = SPEC_KEYWORDS - ANNOTATIONS - {"$defs", "definitions", "$dynamicAnchor", "$recursiveAnchor",
                                           "$vocabulary", "contentSchema"}


class _Empty(Exception):
    """The intersection has no instance."""


class _GiveUp(Exception):
    """No exact intersection here: the node stays as written."""


def precompute_intersections(schema: dict) -> dict:
    """``schema`` with the intersections above written out (the input is not modified)."""
    if not _plain_references(schema):
        return schema
    schema = json.loads(json.dumps(schema))
    _drop_implied_types(schema)
    targets = {unquote(ref[1:]) for _, n in subschemas(schema) if isinstance(n, dict)
               for ref in [n.get("$ref")] if isinstance(ref, str)}
    intersector = _Intersector(schema)
    for pointer, node in list(subschemas(schema)):
        if isinstance(node, dict) and node.get("properties") and node.get("patternProperties") and not any(
                t.startswith((f"{pointer}/properties/", f"{pointer}/patternProperties/")) for t in targets):
            _narrow_universal_pattern(node, intersector)
    if intersector.defs:
        schema.setdefault("$defs", {}).update(intersector.defs)
    return schema


def distribute_siblings(schema: dict) -> dict | None:
    """``schema`` with each node that holds ``allOf`` / ``anyOf`` beside other keywords, and that
    a ``$ref`` leads to or whose applicators hold one, written as the intersection itself
    (``A and (B1 or B2)`` as ``(A and B1) or (A and B2)``, each pair a definition): the same
    instances, and no keywords beside the applicators of a node a recursion re-enters, which
    llguidance refuses ("circular references with sibling keys": a GeoJSON geometry whose
    collection holds geometries). None when no node changes (or the intersections are not exact
    here)."""
    targets = {unquote(ref[1:]) for _, n in subschemas(schema) if isinstance(n, dict)
               for ref in [n.get("$ref")] if isinstance(ref, str)}
    if not any(_recursion_entry(p, n, targets) for p, n in subschemas(schema)) \
            or not _plain_references(schema):
        return None
    schema = json.loads(json.dumps(schema))
    intersector = _Intersector(schema)
    changed = False
    for pointer, node in list(subschemas(schema)):
        if not _recursion_entry(pointer, node, targets):
            continue
        kept = {k: v for k, v in node.items() if k in ("$schema", "definitions", "$defs")}
        rest = {k: v for k, v in node.items() if k not in kept}
        applied = {k: rest.pop(k) for k in ("allOf", "anyOf") if k in rest}
        try:
            both = intersector.both(rest, applied)
            intersector.commit()
        except (_GiveUp, _Empty, RecursionError):
            intersector.rollback()
            continue
        node.clear()
        node.update(kept)
        node.update(both if isinstance(both, dict) else {"not": {}})
        changed = True
    if not changed:
        return None
    if intersector.defs:
        schema.setdefault("$defs", {}).update(intersector.defs)
    return schema


def _recursion_entry(pointer: str, node: Any, targets: set[str]) -> bool:
    """A node with keywords beside ``allOf`` / ``anyOf`` that a ``$ref`` leads to, or whose
    applicators hold one (as an item, or an item's ``anyOf`` / ``oneOf`` member)."""
    if not _siblings_beside_applicators(node):
        return False
    items = [i for key in ("allOf", "anyOf") if isinstance(node.get(key), list) for i in node[key]]
    items += [m for i in items if isinstance(i, dict) for key in ("anyOf", "oneOf")
              if isinstance(i.get(key), list) for m in i[key]]
    return pointer in targets or any(isinstance(i, dict) and "$ref" in i for i in items)


def _siblings_beside_applicators(node: Any) -> bool:
    return isinstance(node, dict) and any(k in node for k in ("allOf", "anyOf")) and bool(
        _bare({k: v for k, v in node.items() if k not in ("allOf", "anyOf", "definitions", "$defs")}))


def _plain_references(schema: dict) -> bool:
    """Every ``$ref`` is a local JSON pointer and no nested ``$id`` moves the base URI."""
    for pointer, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return False
        if pointer and any(isinstance(node.get(k), str) for k in ("$id", "id", "$anchor")):
            return False
        if any(k in node for k in ("$dynamicRef", "$recursiveRef")):
            return False
    return True


def _drop_implied_types(schema: dict) -> None:
    """Drop each ``type`` that the applicators beside it already imply (exact: same instances)."""
    for _, node in subschemas(schema):
        if not isinstance(node, dict) or "type" not in node or not any(k in node for k in _APPLICATORS):
            continue
        declared = type_list(node["type"])
        if declared is None or ("integer" in declared and "number" not in declared):
            continue  # "integer" admits 2.0, which the rest's "number" may mean: not compared
        rest = {k: v for k, v in node.items() if k != "type"}
        if possible_types(rest, schema) <= set(declared):
            del node["type"]


def _matches_every_name(pattern: str) -> bool:
    try:  # a cheap first look: most patterns miss one of these names (a DFA costs ~0.1 s)
        if not all(re.search(pattern, name) for name in ("", "a", "Z9_-", "\n", "\u00e9")):
            return False
    except (re.error, RecursionError, OverflowError):
        return False

    language = pattern_language(pattern)
    try:
        return language is not None and language.everythingbut().empty()
    except Exception:  # interegular gave up: nothing is promised
        return False


def _narrow_universal_pattern(node: dict, intersector: "_Intersector") -> None:
    """The one catch-all pattern of an object stops matching its listed names, whose schemas
    take the pattern's in; left as written when an intersection is not exact."""
    props, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(props, dict) or not props or not isinstance(patterns, dict):
        return
    universal = [p for p in patterns if _matches_every_name(p)]
    if len(universal) != 1:
        return  # none, or overlapping patterns (which the backends refuse anyway)
    pattern = universal[0]
    try:
        narrowed = {name: intersector.both(sub, patterns[pattern]) for name, sub in props.items()}
    except (_GiveUp, RecursionError):
        intersector.rollback()
        return
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if any(narrowed.get(name) is False for name in required):
        intersector.rollback()
        return  # no object qualifies: the backends say so (or drop this branch) as written
    intersector.commit()
    others = ecma_regex("^" + complement_regex(list(props)) + "$", json_string=True)
    node["properties"] = narrowed
    node["patternProperties"] = {(others if p == pattern else p): s for p, s in patterns.items()}


class _Intersector:
    """Exact intersections of subschemas of one root; ``$ref`` pairs become definitions."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.defs: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._names: dict[tuple[str, str], str] = {}
        self._steps = 0

    def commit(self) -> None:
        self.defs.update(self._pending)
        self._pending, self._steps = {}, 0

    def rollback(self) -> None:
        for key in [k for k, name in self._names.items() if name in self._pending]:
            del self._names[key]
        self._pending, self._steps = {}, 0

    def both(self, a: Any, b: Any) -> Any:
        """A schema whose instances are those of ``a`` and of ``b``; _GiveUp when not exact."""
        self._steps += 1
        if self._steps > MAX_STEPS:
            raise _GiveUp
        if a is False or b is False:
            return False
        if _trivial(a):
            return b
        if _trivial(b):
            return a
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise _GiveUp
        bare_a, bare_b = _bare(a), _bare(b)
        if _canon(bare_a) == _canon(bare_b):
            return a
        if set(bare_a) == {"$ref"} or set(bare_b) == {"$ref"}:
            return self._definition(bare_a, bare_b)
        for x, y in ((bare_a, bare_b), (bare_b, bare_a)):
            if isinstance(x.get("allOf"), list):  # A and (B1 and B2 ...) with A's other keywords
                result: Any = y
                for part in [_without(x, "allOf"), *x["allOf"]]:
                    result = self.both(part, result)
                return result
            if isinstance(x.get("$ref"), str) and len(x) > 1:  # siblings of $ref apply (draft 2019+)
                return self.both(self.both({"$ref": x["$ref"]}, _without(x, "$ref")), y)
            if isinstance(x.get("anyOf"), list):  # A and (B1 or B2) = (A and B1) or (A and B2)
                rest = self.both(_without(x, "anyOf"), y)
                options = [o for o in (self.both(option, rest) for option in x["anyOf"]) if o is not False]
                return {"anyOf": options} if options else False
        return self._merge(bare_a, bare_b)

    def _definition(self, a: dict, b: dict) -> dict:
        key = tuple(sorted((_canon(a), _canon(b))))
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"{DEFS_PREFIX}{len(self._names)}"
            self._pending[name] = True  # reserved: a recursive pair finds its name here
            self._pending[name] = self.both(self._target(a), self._target(b))
        if self._pending.get(name, self.defs.get(name)) is False:
            return False  # llguidance refuses a definition it can prove empty, even unused
        return {"$ref": f"#/$defs/{name}"}

    def _target(self, node: dict) -> Any:
        if set(node) != {"$ref"}:
            return node
        name = node["$ref"].removeprefix("#/$defs/")
        if name.startswith(DEFS_PREFIX) and (name in self._pending or name in self.defs):
            target = self._pending.get(name, self.defs.get(name))
            if target is True:  # still being computed: the pair is intersected with itself
                raise _GiveUp
            return target
        target = resolve(node, self.root)
        if target is node or (isinstance(target, dict) and "$ref" in target and len(target) == 1):
            raise _GiveUp
        return target

    def _merge(self, a: dict, b: dict) -> Any:
        """Two schemas without applicators, keyword by keyword."""
        if not set(a) | set(b) <= _MERGED:
            raise _GiveUp
        out: dict[str, Any] = {}
        for key in set(a) ^ set(b):
            if key not in _OBJECT_KEYS and key not in _NUMBER_BOUNDS:
                out[key] = a[key] if key in a else b[key]
        if "type" in a and "type" in b:
            types = _types(a["type"]) & _types(b["type"])
            if not types:
                return False
            out["type"] = sorted(types - {"integer"} if "number" in types else types)
        for lo in _LOWER_BOUNDS:
            if lo in a and lo in b:
                out[lo] = max(a[lo], b[lo])
        for hi in _UPPER_BOUNDS:
            if hi in a and hi in b:
                out[hi] = min(a[hi], b[hi])
        for key in _SAME_OR_ONE:
            if key in a and key in b:
                if _canon(a[key]) != _canon(b[key]):
                    raise _GiveUp
                out[key] = a[key]
        out.update(_number_bounds(a, b))
        if "required" in a and "required" in b:
            out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
        if a.get("uniqueItems") is True or b.get("uniqueItems") is True:
            out["uniqueItems"] = True
        else:
            out.pop("uniqueItems", None)  # false says nothing (and not every backend reads it)
        if "items" in a and "items" in b:
            if isinstance(a["items"], list) or isinstance(b["items"], list):
                raise _GiveUp
            out["items"] = self.both(a["items"], b["items"])
        try:
            self._merge_properties(a, b, out)
        except _Empty:
            return False
        if any(k in side for side in (a, b) for k in ("enum", "const")):
            return self._literals(a, b)
        return out

    def _merge_properties(self, a: dict, b: dict, out: dict) -> None:
        """``properties`` / ``patternProperties`` / ``additionalProperties`` of both sides. The
        patterns merge when both sides have the same ones, or one side has none and allows
        every unlisted member."""
        props_a, props_b = a.get("properties", {}), b.get("properties", {})
        pats_a, pats_b = a.get("patternProperties", {}), b.get("patternProperties", {})
        if not all(isinstance(m, dict) for m in (props_a, props_b, pats_a, pats_b)):
            raise _GiveUp
        rest_a, rest_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
        if pats_a or pats_b:
            if _canon(pats_a) == _canon(pats_b):
                out["patternProperties"] = pats_a
            elif not pats_b and _trivial(rest_b) or not pats_a and _trivial(rest_a):
                out["patternProperties"] = pats_a or pats_b
            else:
                raise _GiveUp
        names = list(dict.fromkeys([*props_a, *props_b]))
        if names:
            out["properties"] = {n: self.both(_member(props_a, pats_a, rest_a, n, self),
                                              _member(props_b, pats_b, rest_b, n, self)) for n in names}
            required = set(a.get("required", [])) | set(b.get("required", []))
            if any(out["properties"][n] is False for n in required if n in out["properties"]):
                raise _Empty
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self.both(rest_a, rest_b)

    def _literals(self, a: dict, b: dict) -> Any:
        """``enum`` / ``const`` on either side: the listed values both sides accept."""
        listing = a if "enum" in a or "const" in a else b
        values = [listing["const"]] if "const" in listing else listing["enum"]
        draft = self.root.get("$schema")
        checks = [instance_validator({**side, "$schema": draft} if isinstance(draft, str) else side, self.root)
                  for side in (a, b)]
        if not isinstance(values, list) or any(check is None for check in checks):
            raise _GiveUp
        kept = [v for v in values if all(check(v) for check in checks)]
        return {"enum": kept} if kept else False


def _member(props: dict, patterns: dict, rest: Any, name: str, intersector: "_Intersector") -> Any:
    """The schema one side gives the member ``name``."""
    if name in props:
        schema = props[name]
    else:
        matching = [sub for pattern, sub in patterns.items() if _matches(pattern, name)]
        if not matching:
            return rest
        schema = True
        for sub in matching:
            schema = intersector.both(schema, sub)
        return schema
    for pattern, sub in patterns.items():
        if _matches(pattern, name):
            schema = intersector.both(schema, sub)
    return schema


def _matches(pattern: str, name: str) -> bool:
    language = pattern_language(pattern)
    if language is None:
        raise _GiveUp
    return bool(language.accepts(name))


def _number_bounds(a: dict, b: dict) -> dict:
    """The tighter lower and upper bounds of both sides, in the form the schema writes them
    (draft-04's ``exclusiveMinimum: true`` beside ``minimum``, or a number of its own)."""
    out: dict[str, Any] = {}
    legacy = any(isinstance(side.get(k), bool) for side in (a, b) for k in ("exclusiveMinimum", "exclusiveMaximum"))
    for inclusive, exclusive, tighter in (("minimum", "exclusiveMinimum", max), ("maximum", "exclusiveMaximum", min)):
        bounds = []
        for side in (a, b):
            if _is_number(side.get(inclusive)):
                bounds.append((side[inclusive], side.get(exclusive) is True))
            if _is_number(side.get(exclusive)):
                bounds.append((side[exclusive], True))
        if not bounds:
            continue
        sign = 1 if tighter is max else -1  # on a tie the exclusive bound is the tighter
        value, is_exclusive = tighter(bounds, key=lambda bound: (bound[0], sign * bound[1]))
        if legacy:
            out[inclusive] = value
            if is_exclusive:
                out[exclusive] = True
        else:
            out[exclusive if is_exclusive else inclusive] = value
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _types(value: Any) -> set[str]:
    types = type_list(value)
    if types is None:
        raise _GiveUp
    return set(types)


def _without(node: dict, key: str) -> dict:
    return {k: v for k, v in node.items() if k != key}


def _trivial(node: Any) -> bool:
    return node is True or isinstance(node, dict) and not _bare(node)


def _bare(node: dict) -> dict:
    """The keywords of ``node`` that constrain instances (names no draft defines, such as
    ``javaInterfaces``, are annotations to a validator)."""
    return {k: v for k, v in node.items() if k in _KEYWORDS}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)

