"""Whether two schemas can accept the same instance, decided conservatively (by their types,
literals, patterns, discriminating properties and closed objects): ``oneOf`` over disjoint
branches is an ``anyOf``."""

from __future__ import annotations

from typing import Any

from ..regex.disjoint import patterns_disjoint
from .keywords import ALL_TYPES, SPEC_KEYWORDS, meaningful, type_list
from .tree import resolve
from .validation import instance_validator, same_value_key

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
    if "object" in types and no_object(node, root):
        types.discard("object")
    return types


MAX_OBJECT_PARTS = 64  # subschemas an object must meet together, looked at by no_object


def no_object(node: Any, root: dict, blockers: tuple = (), depth: int = 0) -> bool:
    """Whether no object satisfies ``node`` (and ``blockers``, subschemas it must meet too)
    because it must have a key one of them rules out: ``required`` names a key whose
    ``properties`` value is ``false``, or one that a closed object (``additionalProperties:
    false``, no ``patternProperties``) does not list (``{"properties": {"url": {}}, "required":
    ["weblink"], "additionalProperties": false}``), in the node, its ``allOf`` members, the
    targets of its references or in every branch of an ``anyOf`` / ``oneOf`` it holds.
    Conservative: False where it cannot tell."""
    node = resolve(node, root)
    if node is False:
        return True
    if not isinstance(node, dict) or depth > 8:
        return False
    parts, stack = [], [node]
    while stack and len(parts) < MAX_OBJECT_PARTS:
        part = resolve(stack.pop(), root)
        if part is False:
            return True
        if not isinstance(part, dict) or any(part is p for p in parts):
            continue
        declared = type_list(part.get("type")) if "type" in part else None
        if declared is not None and "object" not in declared:
            return True
        parts.append(part)
        if isinstance(part.get("allOf"), list):
            stack.extend(part["allOf"])
        if isinstance(part.get("$ref"), str) and len(part) > 1:
            stack.append({"$ref": part["$ref"]})
    every = (*blockers, *parts)
    required = {k for p in every if isinstance(p.get("required"), list) for k in p["required"] if isinstance(k, str)}
    if any(_rules_out(p, k) for k in required for p in every):
        return True
    for part in parts:
        for key in ("anyOf", "oneOf"):
            branches = part.get(key)
            if isinstance(branches, list) and branches and all(
                    no_object(b, root, every, depth + 1) for b in branches):
                return True
    return False


def _rules_out(node: dict, key: str) -> bool:
    """Whether an object meeting ``node`` cannot have ``key``."""
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    if key in props:
        return props[key] is False
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def _discriminators(node: Any, root: dict, depth: int = 0) -> dict[str, tuple[list[Any], bool]]:
    """Properties with literal values (const/enum) -> (values, required). A property listed by
    the node and its ``allOf`` members takes only the values every one of them lists (an
    ``enum`` of every kind beside the ``oneOf``, one kind in each branch: the branch's)."""
    node = resolve(node, root)
    if not isinstance(node, dict) or depth > 8:
        return {}
    out: dict[str, tuple[list[Any], bool]] = {}
    req = {n for n in node.get("required") or [] if isinstance(n, str)} \
        if isinstance(node.get("required"), list) else set()
    for name, sub in (node.get("properties") or {}).items():
        sub = resolve(sub, root)
        if isinstance(sub, dict):
            lits = _literal_values(sub)
            if lits is not None:
                out[name] = (lits, name in req)
    for part in node.get("allOf") or []:
        for name, (lits, required) in _discriminators(part, root, depth + 1).items():
            if name in out:
                listed = {same_value_key(v) for v in lits}
                out[name] = ([v for v in out[name][0] if same_value_key(v) in listed], out[name][1] or required)
            else:
                out[name] = (lits, required or name in req)
    return out


MAX_DISJOINT_DEPTH = 4  # property values compared inside property values, at most
MAX_PARTS = 32  # subschemas an instance must satisfy together, gathered from allOf / $ref
MAX_LITERALS = 256  # listed values checked one by one against the other schema
MAX_ALTERNATIVES = 16  # anyOf / oneOf branches compared one by one with the other schema


def _disjoint(a: Any, b: Any, root: dict, depth: int = 0) -> bool:
    ta, tb = possible_types(a, root), possible_types(b, root)
    if not ta & tb:
        return True
    ra, rb = resolve(a, root), resolve(b, root)
    if not (isinstance(ra, dict) and isinstance(rb, dict)):
        return False
    pa, pb = _parts(ra, root), _parts(rb, root)
    la, lb = _first_literals(pa), _first_literals(pb)
    if la is not None and lb is not None and not ({same_value_key(v) for v in la} & {same_value_key(v) for v in lb}):
        return True
    if ta & tb <= {"string"} and any(_patterns_exclude(x, y) for x in pa for y in pb):
        return True
    if ta & tb <= {"object"}:
        if no_object({"allOf": [ra, rb]}, root):  # what one requires, the other rules out
            return True
        da, db = _discriminators(ra, root), _discriminators(rb, root)
        for name in set(da) & set(db):
            (va, ra_), (vb, rb_) = da[name], db[name]
            if (ra_ or rb_) and not ({same_value_key(v) for v in va} & {same_value_key(v) for v in vb}):
                return True
        if _closed_exclusion(pa, pb) or _closed_exclusion(pb, pa):
            return True
        if _count_exclusion(pa, pb) or _count_exclusion(pb, pa):
            return True
        if depth < MAX_DISJOINT_DEPTH and _property_values_disjoint(pa, pb, root, depth):
            return True
    if _literals_fail(la, rb, root) or _literals_fail(lb, ra, root):
        return True
    return depth < MAX_DISJOINT_DEPTH and (_alternatives_disjoint(pa, rb, root, depth)
                                           or _alternatives_disjoint(pb, ra, root, depth))


def _alternatives_disjoint(parts: list[dict], other: dict, root: dict, depth: int) -> bool:
    """A part is an ``anyOf`` / ``oneOf`` none of whose branches ``other`` shares an instance
    with: every instance of the part's schema matches some branch, so none is ``other``'s."""
    for part in parts:
        for key in ("anyOf", "oneOf"):
            branches = part.get(key)
            if isinstance(branches, list) and 0 < len(branches) <= MAX_ALTERNATIVES \
                    and all(_disjoint(b, other, root, depth + 1) for b in branches):
                return True
    return False


def _parts(node: dict, root: dict) -> list[dict]:
    """``node`` and the subschemas every instance of it also satisfies: its ``allOf`` members
    and a ``$ref`` beside other keywords, followed (references resolved) to at most
    :data:`MAX_PARTS`."""
    out: list[dict] = []
    seen: set[int] = set()
    stack = [node]
    while stack and len(out) < MAX_PARTS:
        cur = resolve(stack.pop(), root)
        if not isinstance(cur, dict) or id(cur) in seen:
            continue
        seen.add(id(cur))
        out.append(cur)
        if isinstance(cur.get("$ref"), str) and len(cur) > 1:
            stack.append({"$ref": cur["$ref"]})
        if isinstance(cur.get("allOf"), list):
            stack.extend(reversed(cur["allOf"]))
    return out


def _first_literals(parts: list[dict]) -> list[Any] | None:
    """The values listed by the first part that lists some (every instance is one of them)."""
    for part in parts:
        lits = _literal_values(part)
        if lits is not None:
            return lits
    return None


def _literals_fail(literals: list[Any] | None, other: dict, root: dict) -> bool:
    """Every one of the (few) ``literals`` fails ``other``, checked with jsonschema (in the
    root's draft, references into its definitions allowed). A keyword jsonschema does not
    assert (``format``) only lets more values through: never a wrong "disjoint"."""
    if literals is None or len(literals) > MAX_LITERALS:
        return False
    draft = root.get("$schema") if isinstance(root.get("$schema"), str) else None
    schema = {**other, "$schema": draft} if draft and "$schema" not in other else other
    valid = instance_validator(schema, root)
    if valid is None:
        return False
    try:
        return not any(valid(v) for v in literals)
    except Exception:  # e.g. an overflow in multipleOf: nothing is proven
        return False


def _property_values_disjoint(pa: list[dict], pb: list[dict], root: dict, depth: int) -> bool:
    """A property one side requires has values the two sides' schemas for it never share: no
    object satisfies both (the value would have to satisfy both)."""
    required = _required(pa) | _required(pb)
    for name in required:
        values_a, values_b = _value_schemas(pa, name), _value_schemas(pb, name)
        if values_a and values_b and _disjoint({"allOf": values_a}, {"allOf": values_b}, root, depth + 1):
            return True
    return False


def _required(parts: list[dict]) -> set[str]:
    """The names some part requires (every instance of the parts has them, if an object)."""
    return {n for part in parts if isinstance(part.get("required"), list) for n in part["required"]
            if isinstance(n, str)}


def _value_schemas(parts: list[dict], name: str) -> list[Any]:
    """Schemas the value of property ``name`` satisfies in every object the parts accept: a
    part's ``properties`` entry for it or, where the part does not list it and has no
    ``patternProperties`` (a pattern might take the name instead), its ``additionalProperties``.
    Leaving a part out only widens what the list allows: never a wrong "disjoint"."""
    out: list[Any] = []
    for part in parts:
        props = part.get("properties")
        if isinstance(props, dict) and name in props:
            out.append(props[name])
        elif "additionalProperties" in part and not part.get("patternProperties"):
            out.append(part["additionalProperties"])
    return out


def _count_exclusion(pa: list[dict], pb: list[dict]) -> bool:
    """``a`` requires more names than a part of ``b`` allows properties (``maxProperties``):
    no object has both the names and so few keys."""
    required = len(_required(pa))
    return any(isinstance(part.get("maxProperties"), int) and not isinstance(part["maxProperties"], bool)
               and part["maxProperties"] < required for part in pb)


def _patterns_exclude(a: dict, b: dict) -> bool:
    """No string matches both patterns (then no string satisfies both schemas)."""
    pa, pb = a.get("pattern"), b.get("pattern")
    if not (isinstance(pa, str) and isinstance(pb, str)):
        return False
    return patterns_disjoint(pa, pb)


def _closed_exclusion(pa: list[dict], pb: list[dict]) -> bool:
    """A part of ``a`` requires a property that a part of ``b`` forbids (closed via
    ``additionalProperties: false``, with no ``patternProperties``): every object ``b`` accepts
    satisfies that part too (the parts of a branch wrapped with the keywords beside its
    ``oneOf``, or gathered from its ``allOf`` and ``$ref``), so none has the property."""
    required = {n for part in pa if isinstance(part.get("required"), list) for n in part["required"]
                if isinstance(n, str)}
    if not required:
        return False
    for part in pb:
        if part.get("additionalProperties") is not False or part.get("patternProperties"):
            continue
        props = part.get("properties") or {}
        if isinstance(props, dict) and any(name not in props for name in required):
            return True
    return False


OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
     "maxProperties", "dependencies", "dependentRequired", "dependentSchemas", "propertyNames"}
)


def objects_only_disjoint(branches: list[Any], root: dict, context: dict | None = None,
                          empty_object: bool = False) -> bool:
    """True when two or more branches constrain objects only, with no ``type`` (so every
    non-object matches them, and a ``oneOf`` over them rejects it), and no object can match two
    of the branches: ``oneOf`` then means "an object matching one branch" (a discriminated union
    written without ``type``, with some branches typed or not). ``empty_object``: as in
    :func:`pairwise_disjoint`."""
    return _one_type_disjoint(branches, root, context, "object", OBJECT_KEYWORDS, empty_object)


STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "format"})


def strings_only_disjoint(branches: list[Any], root: dict, context: dict | None = None) -> bool:
    """True when two or more branches constrain strings only, with no ``type`` (every non-string
    matches them, and a ``oneOf`` over them rejects it), and no string can match two of the
    branches: ``oneOf`` then means "a string matching one branch" (``oneOf`` of patterns under
    ``type: string``)."""
    return _one_type_disjoint(branches, root, context, "string", STRING_KEYWORDS)


def _one_type_disjoint(branches: list[Any], root: dict, context: dict | None, type_: str,
                       keywords: frozenset[str], empty_object: bool = False) -> bool:
    typed, untyped = [], 0
    for branch in branches:
        branch = resolve(branch, root)
        if not isinstance(branch, dict):
            return False
        # a key no draft defines (``name``, ``x-go-type``) asserts nothing: a value of another
        # type still matches the branch
        if {k for k in meaningful(branch) if k in SPEC_KEYWORDS} <= keywords:
            untyped += 1  # a value of another type matches this branch
            typed.append({**branch, "type": type_})
        else:
            typed.append({"allOf": [{"type": type_}, branch]})
    return untyped >= 2 and pairwise_disjoint(typed, root, context, empty_object)


def pairwise_disjoint(branches: list[Any], root: dict, context: dict | None = None,
                      empty_object: bool = False) -> bool:
    """True when no instance can match two of the branches (so oneOf == anyOf). With
    ``context`` (keywords every instance in question also satisfies: the ``type``,
    ``required`` and ``properties`` beside the ``oneOf``), only instances satisfying it are
    considered. With ``empty_object``, two branches may also share the empty object ``{}``,
    and nothing else (:func:`share_only_empty_object`)."""
    if context:
        branches = [{"allOf": [context, b]} for b in branches]
    return all(
        _disjoint(branches[i], branches[j], root)
        or empty_object and share_only_empty_object(branches[i], branches[j], root)
        for i in range(len(branches))
        for j in range(i + 1, len(branches))
    )


def share_only_empty_object(a: Any, b: Any, root: dict) -> bool:
    """True when the only instance ``a`` and ``b`` can share is ``{}``: both accept objects
    only (of the types they share), and each has a part (itself, an ``allOf`` member, a
    ``$ref``) closed by ``additionalProperties: false`` with no ``patternProperties``, the two
    listing no property name in common: an object matching both has none of its names."""
    if not possible_types(a, root) & possible_types(b, root) <= {"object"}:
        return False
    ra, rb = resolve(a, root), resolve(b, root)
    if not (isinstance(ra, dict) and isinstance(rb, dict)):
        return False
    closed_a, closed_b = _closed_names(_parts(ra, root)), _closed_names(_parts(rb, root))
    return any(not (x & y) for x in closed_a for y in closed_b)


def _closed_names(parts: list[dict]) -> list[set[str]]:
    """For each part closed by ``additionalProperties: false`` (no ``patternProperties``), the
    names it lists: an object satisfying the part has no other."""
    out = []
    for part in parts:
        props = part.get("properties") or {}
        if part.get("additionalProperties") is False and not part.get("patternProperties") \
                and isinstance(props, dict):
            out.append(set(props))
    return out
