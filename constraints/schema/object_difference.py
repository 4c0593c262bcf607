"""``oneOf`` over object branches that overlap, made exclusive exactly: each branch is conjoined
with the ways an object of it fails every branch it shares objects with, so the branches no
longer share any and ``oneOf`` is their ``anyOf``.

An object ``x`` of branch ``A`` (of plain object keywords) fails branch ``B`` exactly when it

* lacks a name ``B`` requires (``{"properties": {r: false}}``; never, for a name ``A`` or the
  keywords beside the ``oneOf`` require);
* has a property ``k`` that ``B`` lists, with a value ``B`` rejects: nothing to add when ``A``
  gives ``k`` the same schema, "has ``k``" when the two schemas for it are disjoint
  (:mod:`.disjoint`), "has ``k`` with a value of ``B``'s schema's negation" (:mod:`.negation`)
  otherwise, and nothing when ``A`` cannot have ``k`` (closed without it);
* has a name ``B`` does not list, when ``B`` is closed (``additionalProperties: false``): only
  expressible when ``A`` is closed too ("has one of ``A``'s names ``B`` does not list").

When no way is left (``A``'s objects all match ``B``: identical branches, say), ``A`` keeps no
object. Where any step has no exact form the ``oneOf`` is left as it is (and refused by name).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from .disjoint import _disjoint, possible_types
from .keywords import ANNOTATIONS, SPEC_KEYWORDS, type_list
from .negation import all_of, negate
from .tree import resolve
from .way_sets import merged_values, minimal_combinations, value_sources

MAX_BRANCHES = 16  # branches compared pairwise
MAX_WAYS = 16  # copies of one branch, each with one way to fail each branch it overlaps
# what a branch compared by its properties may say (any key no draft defines is an annotation)
_PLAIN_OBJECT = frozenset({"type", "properties", "required", "additionalProperties"})


def exclusive_objects(branches: list[Any], root: dict, context: dict) -> Any:
    """``{"anyOf": [...]}`` accepting exactly the objects that match one branch alone (False:
    none does), or None. Every instance in question is an object (the branches or the
    ``context`` beside the ``oneOf`` say so), every branch of an overlapping pair is of plain
    object keywords. A branch that overlaps others becomes the ``anyOf`` of its copies with
    one way to fail each of them written in (a flat object, as the backends order and
    intersect best), at most :data:`MAX_WAYS` copies."""
    if not 2 <= len(branches) <= MAX_BRANCHES:
        return None
    if any(possible_types(all_of([context, b]), root) - {"object"} for b in branches):
        return None
    plain = [_plain(b, root) for b in branches]
    wrapped = [all_of([context, b]) for b in branches]
    options: list[Any] = []
    for i, branch in enumerate(branches):
        others = [j for j in range(len(branches)) if j != i and not _disjoint(wrapped[i], wrapped[j], root)]
        if not others:
            options.append(branch)
            continue
        if plain[i] is None or any(plain[j] is None for j in others):
            return None
        ways = [_fails(plain[i], plain[j], root, context) for j in others]
        if any(w == [] for w in ways):
            continue  # every object of this branch matches another one too: it keeps none
        if any(w is None for w in ways):
            return None
        combos = minimal_combinations(ways, MAX_WAYS)
        if combos is None:
            return None
        sources = value_sources(ways, [plain[j] for j in others])
        copies = (copy.deepcopy(functools.reduce(_with_way, merged_values(combo, sources, root), plain[i]))
                  for combo in combos)
        options.extend(c for c in copies if _may_hold_required(c, root))
    return {"anyOf": options} if options else False


def _with_way(node: dict, way: dict) -> dict:
    """``node`` (plain object keywords) and ``way`` (``required`` / ``properties``), flat."""
    out = dict(node)
    if way.get("required"):
        out["required"] = list(dict.fromkeys([*node.get("required", []), *way["required"]]))
    props = dict(node.get("properties", {}))
    for name, schema in way.get("properties", {}).items():
        if name not in props or schema is False:
            props[name] = schema
        else:
            props[name] = {"allOf": [props[name], schema]}
    if props:
        out["properties"] = props
    return out


def _may_hold_required(node: dict, root: dict) -> bool:
    """False when a name ``node`` requires can take no value there (its schema is false, or
    two it must satisfy at once are disjoint, or it is closed without it): such a copy keeps
    no object, and llguidance refuses a required property it cannot write."""
    props = node.get("properties", {})
    for name in node.get("required", []):
        if name not in props:
            if node.get("additionalProperties") is False:
                return False
            continue
        value = props[name]
        if value is False:
            return False
        if isinstance(value, dict) and list(value) == ["allOf"] and len(value["allOf"]) == 2 \
                and _disjoint(value["allOf"][0], value["allOf"][1], root):
            return False
    return True


def _plain(branch: Any, root: dict) -> dict | None:
    """The branch (its bare ``$ref`` followed) when it says only plain object keywords, or an
    ``allOf`` of such parts that :func:`flat_parts` writes as one."""
    node = resolve(branch, root)
    if not isinstance(node, dict):
        return None
    if "allOf" in node:
        node = flat_parts(node, root)
        if node is None:
            return None
    said = {k for k in node if k in SPEC_KEYWORDS and k not in ANNOTATIONS}
    if not said <= _PLAIN_OBJECT or not isinstance(node.get("properties", {}), dict):
        return None
    if not isinstance(node.get("required", []), list) or not isinstance(node.get("additionalProperties", True), bool):
        return None
    if "type" in node and type_list(node["type"]) != ["object"]:
        return None
    return node


MAX_FLAT_DEPTH = 4  # allOf inside allOf, followed at most this deep


def flat_parts(node: dict, root: dict, depth: int = 0) -> dict | None:
    """``node`` and its ``allOf`` members (bare references followed) as one node of plain
    object keywords, or None. Exact only for open parts: a part's ``additionalProperties``
    speaks of the names that part lists, so a closed part (or one with a schema for the other
    names) is never merged; a name several parts list gets the ``allOf`` of their schemas."""
    if depth > MAX_FLAT_DEPTH:
        return None
    own = {k: v for k, v in node.items() if k != "allOf"}
    parts = [own]
    for member in node.get("allOf") if isinstance(node.get("allOf"), list) else [None]:
        member = resolve(member, root)
        if not isinstance(member, dict):
            return None
        parts.append(flat_parts(member, root, depth + 1) if "allOf" in member else member)
    merged: dict = {}
    for part in parts:
        if part is None or not _open_plain(part):
            return None
        merged = _merged(merged, part)
    return merged


def _open_plain(part: dict) -> bool:
    said = {k for k in part if k in SPEC_KEYWORDS and k not in ANNOTATIONS}
    return (said <= _PLAIN_OBJECT and part.get("additionalProperties", True) is True
            and isinstance(part.get("properties", {}), dict) and isinstance(part.get("required", []), list)
            and ("type" not in part or type_list(part["type"]) == ["object"]))


def _merged(a: dict, b: dict) -> dict:
    """Two open plain object nodes as one (both hold)."""
    out: dict = {}
    if "type" in a or "type" in b:
        out["type"] = "object"
    props = dict(a.get("properties", {}))
    for name, schema in b.get("properties", {}).items():
        props[name] = schema if name not in props or _same(props[name], schema) else {"allOf": [props[name], schema]}
    if props:
        out["properties"] = props
    required = list(dict.fromkeys([*a.get("required", []), *b.get("required", [])]))
    if required:
        out["required"] = required
    return out


def _fails(a: dict, b: dict, root: dict, context: dict) -> list[dict] | None:
    """The ways an object of ``a`` (beside ``context``) fails ``b``, each a schema the objects
    of ``a`` that fail ``b`` that way match (none: every object of ``a`` matches ``b``), or None
    when a way has no exact form."""
    ways: list[dict] = []
    present = _names(a.get("required")) | _names(context.get("required"))
    ways.extend({"properties": {r: False}} for r in sorted(_names(b.get("required")) - present))
    for name, schema in b.get("properties", {}).items():
        way = _bad_value(name, schema, a, root, context)
        if way is None:
            return None
        if way is not False:
            ways.append(way)
    if b.get("additionalProperties") is False:
        if a.get("additionalProperties") is not False:
            return None
        ways.extend({"required": [k]} for k in a.get("properties", {}) if k not in b.get("properties", {}))
    return ways


def _bad_value(name: str, schema: Any, a: dict, root: dict, context: dict) -> Any:
    """"Has ``name``, with a value ``schema`` rejects", among the objects of ``a``: False when
    none has it so, None when it has no exact form."""
    if a.get("additionalProperties") is False and name not in a.get("properties", {}):
        return False  # a closed a has no such property (a copy listing it would take it)
    own = [s[name] for s in (a.get("properties", {}), context.get("properties", {}))
           if isinstance(s, dict) and name in s]
    if any(_same(s, schema) for s in own):
        return False  # its value satisfies the same schema in a
    if own and _disjoint(all_of(own), schema, root):
        return {"required": [name]}
    neg = negate(schema, root)
    if neg is None:
        return None
    return False if neg is False else {"required": [name], "properties": {name: neg}}


def _names(value: Any) -> set[str]:
    return {n for n in value if isinstance(n, str)} if isinstance(value, list) else set()


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
