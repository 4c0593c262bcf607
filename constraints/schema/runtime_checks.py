"""Keywords no grammar states, checked on the output as it is written: ``uniqueItems`` and
``minProperties`` / ``maxProperties`` over open objects.

A grammar cannot say "no two items equal" over an unbounded item domain, nor count the keys of
an object that takes any key. The matcher can: it sees the text, knows where each value sits
(its *path*: property names, :class:`OtherKey` steps and array positions from the root) and can
refuse the token that would finish a repeated item, a repeated key, an object with too few keys
or a member past the maximum (:mod:`constraints.backends.json_checks`).
:func:`split_runtime_checks` takes such keywords out of the schema the backend compiles and
returns them as :class:`JsonCheck` s, only where that is exact:

* every place the keyword's subschema applies is a known path (reached from the root through
  ``$ref``, ``allOf``/``anyOf``/``oneOf``, ``properties``, ``additionalProperties``, a single
  ``items`` schema and the one ``patternProperties`` pattern of an object that takes no other
  unlisted key, never through ``not``, ``if``, ``contains`` or a recursion), so the check knows
  where to look and removing the keyword lets nothing else through;
* at each such path every valid instance satisfies the keyword (it is not one ``anyOf`` branch
  among others that allow repeats), so checking it at the path refuses nothing valid;
* a refused token always leaves a way on, so the answer never gets stuck: unique items are
  strings of unbounded length, listed strings (at least as many as the items required), objects
  that take further keys or values of unbounded types (a repeat can be written on past; a used
  literal is refused at its first letter), a minimum of keys sits on an object that takes any
  further key, a maximum on one that requires none.

Elsewhere the keyword stays and strict mode refuses it by name, as before.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

from ..regex.analysis import finite_strings
from ..regex.disjoint import patterns_disjoint, unbounded_completions
from ..regex.frontend import schema_pattern
from .key_presence import (NON_OBJECT_TYPES, Formula, KeyPresence, binds_keys, dependency_formula, named_keys,
                           other_types, presence_formula)
from .keywords import ANNOTATIONS, type_list
from .tree import at_pointer, escape_part, pointer_parts, subschemas


class OtherKey(NamedTuple):
    """A path step: any key of an object that none of its subschemas lists (``listed``), whose
    value ``additionalProperties`` describes."""

    listed: frozenset


class PatternKey(NamedTuple):
    """A path step: any key of an object that none of its subschemas lists (``listed``), in an
    object whose only other keys are those its one ``patternProperties`` ``pattern`` takes (so
    every such key matches it)."""

    listed: frozenset
    pattern: str


Path = tuple  # property names (str), OtherKey / PatternKey steps and None for "any array item"
MAX_VISITS = 20_000  # (subschema, path) pairs the walk may visit before it gives up

# in-place applicators: their subschemas describe the same instance
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_SINGLE = ("then", "else")
# where a subschema's path cannot be told (any key, a position, ...) or its meaning is negated
_OPAQUE = ("not", "if", "contains", "propertyNames",
           "prefixItems", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "dependentSchemas",
           "dependencies")
# keys that say nothing of a value by themselves (the subschemas they lead to are looked at;
# not oneOf, whose "exactly one" narrows a union)
_STRUCTURAL = frozenset({"$ref", "allOf", "definitions", "$defs"}) | ANNOTATIONS
# what an unbounded string item may say besides its type (a union of unbounded strings is one)
_PLAIN_STRING = _STRUCTURAL | {"type", "minLength", "anyOf"}
# what makes an object's keys a closed or conditional set
_CLOSING_KEYS = ("patternProperties", "propertyNames", "unevaluatedProperties")


@dataclass(frozen=True)
class JsonCheck:
    """What the matcher checks on the value at ``path`` (property names, :class:`OtherKey`
    steps, None for every item of an array): its items pairwise distinct (strings, listed
    strings, objects or any values); its number of distinct keys within [min_properties,
    max_properties] (repeated keys refused); for an object whose listed properties may come in
    any order (``free_keys``), no repeated key, the ``required`` keys present before it closes
    and, when ``closed``, no key but the listed ones."""

    path: Path
    unique_items: bool = False
    min_properties: int = 0
    max_properties: int | None = None
    item_values: tuple[str, ...] | None = None  # the unique items' strings when they are listed
    object_items: bool = False  # the unique items are objects that take further keys
    any_values: bool = False  # the unique items are any JSON values (of a few unbounded types)
    free_keys: tuple[str, ...] | None = None  # the listed keys of an object written in any order
    required: tuple[str, ...] = ()
    closed: bool = False  # the object takes no key but ``free_keys`` and those ``key_patterns`` match
    key_patterns: tuple[str, ...] = ()
    dependent_required: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (key, the keys it needs)
    presence: KeyPresence | None = None  # the key sets an order-free object may hold

    def merged(self, other: "JsonCheck") -> "JsonCheck":
        highs = [h for h in (self.max_properties, other.max_properties) if h is not None]
        values = self.item_values if self.item_values is not None else other.item_values
        free = self.free_keys if self.free_keys is not None else other.free_keys
        return JsonCheck(self.path, self.unique_items or other.unique_items,
                         max(self.min_properties, other.min_properties), min(highs) if highs else None, values,
                         self.object_items or other.object_items, self.any_values or other.any_values,
                         free, tuple(sorted({*self.required, *other.required})), self.closed or other.closed,
                         self.key_patterns or other.key_patterns,
                         tuple(sorted({*self.dependent_required, *other.dependent_required})),
                         self.presence or other.presence)

    @property
    def on_object(self) -> bool:
        """Whether an object at the path is checked (its keys counted, required or unique)."""
        return bool(self.min_properties) or self.max_properties is not None or self.free_keys is not None


def split_runtime_checks(schema: Any, free_order: bool = True,
                         free_small: bool = False) -> tuple[Any, tuple[JsonCheck, ...]]:
    """``schema`` without the keywords that are checked at run time instead, and those checks
    (``schema`` itself and no checks when none applies; the input is not modified). With
    ``free_order``, objects of many listed properties take them in any order where that is exact;
    with ``free_small`` alone, only objects of fewer than :data:`FREE_ORDER_MIN` listed properties
    whose keys a subschema binds by presence (the orders the default spells out for small
    objects, which no spelled-out order reaches beside such a subschema)."""
    if not isinstance(schema, dict) or any(isinstance(n, dict) and _UNFOLLOWED.intersection(n)
                                           for _, n in subschemas(schema)):
        return schema, ()
    root = copy.deepcopy(schema)
    walk = _Walk(root)
    if not walk.run():
        return schema, ()
    placed = [(walk.nodes[i], paths) for i, paths in walk.paths.items() if i not in walk.unplaceable]
    found = [(node, *f) for node, paths in placed if (f := _node_checks(root, node, paths)) is not None]
    # an item is compared whole once it closes (its text kept as it is written): no other item
    # compared whole may sit inside one (the matcher keeps one such text at a time); checks of
    # other kinds inside one run as they do elsewhere, and the item, an object that takes
    # further keys, still has a way on past a repeat
    whole_paths = [c.path for _, _, node_checks in found for c in node_checks if c.object_items or c.any_values]
    found = [(node, keys, node_checks) for node, keys, node_checks in found
             if not any((c.object_items or c.any_values) and any(_below(p, c.path) for p in whole_paths)
                        for c in node_checks)]
    pinned = _properties_referenced(root) if free_order or free_small else set()
    free = [(node, f) for node, paths in placed if (free_order or (free_small and _small_bound(node)))
            and id(node) not in pinned and (f := _free_order(root, node, paths)) is not None]
    checks: dict[Path, JsonCheck] = {}
    for check in [c for _, _, node_checks in found for c in node_checks] + [c for _, f in free for c in f.checks]:
        checks[check.path] = checks[check.path].merged(check) if check.path in checks else check
    if not checks:
        return schema, ()
    for node, keys, _ in found:
        for key in keys:
            node.pop(key, None)
    for node, freeing in free:
        _free_the_order(node, freeing)
    return root, tuple(checks[p] for p in sorted(checks, key=repr))


def _below(path: Path, above: Path) -> bool:
    return len(path) > len(above) and path[:len(above)] == above


def _properties_referenced(root: dict) -> set[int]:
    """The ids of the nodes whose ``properties`` a local ``$ref`` points into (freeing their
    order would move what it names)."""
    pinned: set[int] = set()
    for _, node in subschemas(root):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            continue
        parts = pointer_parts(ref[1:])
        for i, part in enumerate(parts):
            if part == "properties":
                holder = at_pointer(root, "".join("/" + escape_part(p) for p in parts[:i]))
                if isinstance(holder, dict):
                    pinned.add(id(holder))
    return pinned


# -- properties in any order ----------------------------------------------------------------------
#
# llguidance and xgrammar write an object's listed properties in the order ``properties`` gives
# them; :mod:`.property_order` spells out every order of a small object. A larger one has its
# ``properties`` turned into ``patternProperties`` of the exact key names (the backend then takes
# them in any order, each with its own value schema, but any number of times) and its
# ``required`` taken out: the matcher refuses a repeated key, a close before the required keys
# and, when the object takes no other key, a key no unused name can complete.

FREE_ORDER_MIN = 5  # closed objects of fewer listed properties get every order spelled out
# set on an object made order-free: the patterns of its exact names, disjoint from each other
# and from the patterns it had (an annotation to validators and backends)
FREED_MARK = "x-trellis-free-order"
# distinct value schemas of one order-free object (each is one pattern: llguidance's compile
# time grows faster than linearly with an object's patterns)
FREE_ORDER_MAX_PATTERNS = 48
# what an order-free object may not say beside its properties: keywords that bind its keys in a
# way the rewrite would change, or whose meaning a new place could change (its in-place
# subschemas, ``allOf`` / ``$ref`` / ..., are looked at as other subschemas at the same place)
_NOT_FREED_BESIDE = frozenset({"propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
                               "unevaluatedProperties", "minProperties", "maxProperties", "enum", "const",
                               "$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor", "extends",
                               "disallow"})
# keywords of another subschema at the same place that would bind the object's keys
_OBJECT_KEYWORDS = frozenset({"properties", "required", "patternProperties", "additionalProperties", "propertyNames",
                              "minProperties", "maxProperties", "dependencies", "dependentRequired",
                              "dependentSchemas", "unevaluatedProperties", "enum", "const"})
_PATTERN_SPECIALS = frozenset("\\^$.|?*+()[]{}/")


def _many_properties(node: dict) -> bool:
    """Whether ``node``'s listed properties are freed rather than spelled out in every order:
    many of them, or any beside the unlisted keys ``additionalProperties`` takes (no spelled-out
    order puts an unlisted key between listed ones: the backends write the unlisted keys last).
    Not beside ``patternProperties`` (the exact-name patterns cost llguidance a disjointness
    proof) nor with required keys (left in the grammar, llguidance tells one that no value can
    meet; checked at run time, it would leave an object that can never close)."""
    props = node.get("properties")
    if not isinstance(props, dict) or not props:
        return False
    return len(props) >= FREE_ORDER_MIN or (node.get("additionalProperties", True) is not False
                                            and not node.get("patternProperties") and not node.get("required"))


class _Freeing(NamedTuple):
    """How an object is made order-free: its checks, its keys grouped by value schema (one
    pattern each), the ids of the ``allOf`` members stating dependencies or key presence the
    checks take, the node's own combinators they take, and the types it keeps (None: as it is)."""

    checks: list[JsonCheck]
    groups: list[tuple[str, ...]]
    dependency_members: set[int]
    presence_keywords: tuple[str, ...] = ()
    types: list[str] | None = None


def _free_order(root: dict, node: dict, paths: set[Path]) -> _Freeing | None:
    """How ``node``'s listed properties may come in any order at ``paths``, or None where that
    would not be exact: the node says more than its properties, another subschema at one of its
    places binds the keys, or it does not apply to every object there."""
    if not (_many_properties(node) or _presence_bound(node)) or _NOT_FREED_BESIDE.intersection(node) or not _admits(
            node, "object"):
        return None
    props, required = node["properties"], node.get("required", [])
    if not all(_plain_key(k) for k in props) or not isinstance(required, list) or not set(required) <= set(props):
        return None
    patterns = node.get("patternProperties", {})
    if not isinstance(patterns, dict) or not all(
            patterns_disjoint(_exact_pattern(k), p) for k in props for p in patterns):
        return None  # a listed key a pattern also takes must meet both subschemas
    extra, groups = node.get("additionalProperties", True), _key_groups(props)
    if not isinstance(extra, (bool, dict)) or len(groups) > FREE_ORDER_MAX_PATTERNS:
        return None
    dependencies = _dependency_members(node)
    if not all(set(needed) | {name} <= set(props) for _, _, name, needed in dependencies):
        return None
    known = {id(n) for member, held, _, _ in dependencies for n in (member, *held)}
    parts = _presence_parts(node, known)
    known |= {i for _, part, _ in parts for i in _node_ids(part)}
    for path in paths:
        if any(other is not node and id(other) not in known and _OBJECT_KEYWORDS.intersection(other)
               for other in _applying(root, path)):
            return None
        if not _forces(root, root, path, lambda n: n is node, "object", {}):
            return None
    closed = extra is False
    named, open_patterns = [], []  # a closed object's other keys: spelled out, or never exhausted
    for pattern in patterns if closed else ():
        names = finite_strings(pattern)
        if names is not None:
            named += [n for n in names if n not in props]
        elif unbounded_completions(pattern):
            open_patterns.append(pattern)
        else:
            return None  # used keys could leave a key in progress no way on
    needs = tuple(sorted((name, needed) for _, _, name, needed in dependencies))
    takes = tuple(k for k, v in props.items() if v is not False)  # a key whose value is false is never written
    if not set(required) <= set(takes):
        return None  # a required key no value can follow: the object never closes (left to the backend to tell)
    presence, types = None, None
    if parts:  # the dependencies join the formulas: one check answers for all of them
        formulas = [f for _, _, f in parts] + [dependency_formula(name, needed) for name, needed in needs]
        kinds = other_types([f for _, _, f in parts])
        named_by = set().union(*(named_keys(f) for f in formulas))
        if kinds is None or not named_by <= set(props) | set(named):
            return None
        # the required keys the formulas also name join them (the others are checked apart)
        presence = KeyPresence.of(formulas + [("has", k) for k in required if k in named_by], set(takes) | set(named))
        if presence is None:
            return None
        needs, types = (), _narrowed_types(node.get("type"), kinds)
    checks = [JsonCheck(path, free_keys=takes + tuple(named), required=tuple(sorted(set(required))), closed=closed,
                        key_patterns=tuple(open_patterns), dependent_required=needs, presence=presence)
              for path in paths]
    members = {id(member) for member, _, _, _ in dependencies} | {id(part) for keyword, part, _ in parts
                                                                 if keyword == "allOf"}
    return _Freeing(checks, groups, members, tuple(k for k, _, _ in parts if k != "allOf"), types)


def _small_bound(node: dict) -> bool:
    return len(node.get("properties") or ()) < FREE_ORDER_MIN and _presence_bound(node)


def _presence_bound(node: dict) -> bool:
    """Whether ``node`` lists properties and binds its keys by presence: freed however few they
    are (no spelled-out order takes such a subschema beside it)."""
    props = node.get("properties")
    return isinstance(props, dict) and bool(props) and bool(_presence_parts(node, set()))


def _presence_parts(node: dict, skipped: set[int]) -> list[tuple[str, Any, Formula]]:
    """The subschemas of ``node`` that bind its keys by presence alone (:mod:`.key_presence`):
    (``allOf`` and the member, or the node's own ``anyOf`` / ``oneOf`` / ``not`` and its value,
    and the formula); members in ``skipped`` (dependencies) left out."""
    found = []
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for member in node.get("allOf") or []:
        if isinstance(member, dict) and id(member) not in skipped:
            formula = presence_formula(member, listed)
            if formula is not None and binds_keys(formula):
                found.append(("allOf", member, formula))
    for keyword in ("anyOf", "oneOf", "not"):
        if keyword in node:
            formula = presence_formula({keyword: node[keyword]}, listed)
            if formula is not None and binds_keys(formula):
                found.append((keyword, node[keyword], formula))
    return found


def _node_ids(part: Any) -> set[int]:
    """The ids of ``part`` and the subschemas within it (lists of them included)."""
    if isinstance(part, list):
        return set().union(*(_node_ids(p) for p in part)) if part else set()
    if not isinstance(part, dict):
        return set()
    found = {id(part)}
    for keyword in ("allOf", "anyOf", "oneOf", "not"):
        if keyword in part:
            found |= _node_ids(part[keyword])
    return found


def _narrowed_types(current: Any, kinds: tuple[str, ...]) -> list[str] | None:
    """The node's types once the presence subschemas, which admit objects and ``kinds``, leave
    it (None: no change)."""
    if len(kinds) == len(NON_OBJECT_TYPES):
        return None
    listed = type_list(current) if current is not None else ["object", *NON_OBJECT_TYPES]
    allowed = {"object", *kinds}
    return [t for t in listed or () if t in allowed] + (
        ["integer"] if "number" in (listed or ()) and "number" not in allowed and "integer" in allowed else [])


def _dependency_members(node: dict) -> list[tuple[dict, list[dict], str, tuple[str, ...]]]:
    """The members of ``node``'s ``allOf`` that state property dependencies as the rewrite of
    ``dependencies`` writes them (``{"anyOf": [{"properties": {name: false}}, {"required":
    [name, *needed]}]}``, or an ``allOf`` of those): (member, the subschemas it holds, name,
    the keys it needs), once per dependency."""
    found = []
    for member in node.get("allOf") or []:
        parts = member.get("allOf") if isinstance(member, dict) and set(member) == {"allOf"} else [member]
        stated = [_dependency(part) for part in parts] if isinstance(parts, list) else [None]
        if stated and all(d is not None for d in stated):
            for part, (name, needed) in zip(parts, stated):
                found.append((member, [part, *part["anyOf"]], name, needed))
    return found


def _dependency(part: Any) -> tuple[str, tuple[str, ...]] | None:
    branches = part.get("anyOf") if isinstance(part, dict) and set(part) == {"anyOf"} else None
    if not isinstance(branches, list) or len(branches) != 2:
        return None
    absent, present = branches
    if not (isinstance(absent, dict) and set(absent) == {"properties"} and isinstance(absent["properties"], dict)
            and list(absent["properties"].values()) == [False]):
        return None
    (name,) = absent["properties"]
    needed = present.get("required") if isinstance(present, dict) and set(present) == {"required"} else None
    if isinstance(needed, list) and needed and needed[0] == name and all(isinstance(k, str) for k in needed):
        return name, tuple(needed[1:])
    return None


def _plain_key(key: str) -> bool:
    """A key whose exact pattern is plain: printable BMP characters, no quote or backslash."""
    return all(" " <= ch <= "\uffff" and ch not in '"\\' and not "\ud800" <= ch <= "\udfff" for ch in key)


def _free_the_order(node: dict, freeing: _Freeing) -> None:
    """``node`` (changed in place) with its properties as exact-name patterns, any order."""
    for keyword in freeing.presence_keywords:
        node.pop(keyword, None)
    if freeing.types is not None:
        node["type"] = freeing.types
    if freeing.dependency_members:
        node["allOf"] = [m for m in node["allOf"] if id(m) not in freeing.dependency_members]
        if not node["allOf"]:
            del node["allOf"]
    props = node.pop("properties")
    node.pop("required", None)
    named = {_names_pattern(keys): props[keys[0]] for keys in freeing.groups}
    node["patternProperties"] = {**named, **node.get("patternProperties", {})}
    node[FREED_MARK] = list(named)


def _key_groups(props: dict) -> list[tuple[str, ...]]:
    """The listed keys grouped by equal value schemas (one pattern each), in listed order."""
    groups: dict[str, list[str]] = {}
    for key, value in props.items():
        groups.setdefault(json.dumps(value, sort_keys=True), []).append(key)
    return [tuple(keys) for keys in groups.values()]


def _names_pattern(keys: tuple[str, ...]) -> str:
    """The backend pattern of exactly these keys."""
    if len(keys) == 1:
        return _exact_pattern(keys[0])
    regex = schema_pattern("^(?:" + "|".join(map(_escaped, keys)) + ")$")
    assert regex is not None  # literals always match themselves
    return regex


def _escaped(key: str) -> str:
    return "".join("\\" + ch if ch in _PATTERN_SPECIALS else ch for ch in key)


@functools.lru_cache(maxsize=4096)
def _exact_pattern(key: str) -> str:
    regex = schema_pattern(f"^{_escaped(key)}$")
    assert regex is not None  # a literal always matches itself
    return regex


def _node_checks(root: dict, node: dict, paths: set[Path]) -> tuple[tuple[str, ...], list[JsonCheck]] | None:
    """The keywords of ``node`` (applying at ``paths``) to check at run time, with their checks."""
    keys: list[str] = []
    checks: list[JsonCheck] = []
    domains = {p: _unique_domain(root, p) for p in paths} if node.get("uniqueItems") is True else {}
    if domains and all(d is not False for d in domains.values()):
        keys.append("uniqueItems")
        checks += [JsonCheck(p, unique_items=True, item_values=d if isinstance(d, tuple) else None,
                             object_items=d == _OBJECTS, any_values=d == _VALUES) for p, d in domains.items()]
    low, high = _count(node.get("minProperties")), _count(node.get("maxProperties"))
    if high == 0:  # no key at all: the backends' own {} (a key's opening quote is never refused)
        return (tuple(keys), checks) if keys else None
    if (low or high is not None) and all(_counts_hold(root, p, low, high) for p in paths):
        keys += [k for k in ("minProperties", "maxProperties") if k in node]
        checks += [JsonCheck(p, min_properties=low or 0, max_properties=high) for p in paths]
    return (tuple(keys), checks) if keys else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_OBJECTS = "objects"
_VALUES = "values"
_UNBOUNDED_TYPES = frozenset({"string", "number", "integer", "object", "array"})


def _unique_domain(root: dict, path: Path) -> tuple[str, ...] | str | None | bool:
    """Whether every array at ``path`` must have distinct items, and what they are: None for
    strings of unbounded length (a repeat can be written on past), the listed strings for an
    ``enum``/``const`` domain (the matcher then also refuses a prefix that only repeats can
    complete), ``"objects"`` for objects that take any further key (a repeat can be told apart
    by one more key before it closes), ``"values"`` for values of a few unbounded types,
    compared whole; False when none of these holds."""
    if not _forces(root, root, path, lambda n: n.get("uniqueItems") is True, "array", {}):
        return False
    item = (*path, None)
    applying = list(_applying(root, item))
    if _unbounded_strings(applying) and _forces(
            root, root, item, lambda n: type_list(n.get("type")) == ["string"], None, {}):
        return None
    if _open_string_items(root, path):
        return None
    listed = _listed_strings(root, path, applying)
    if listed is not None:
        return listed
    if _open_objects(root, item):
        return _OBJECTS
    return _VALUES if _any_values(root, item) else False


def _unbounded_strings(applying: list[dict]) -> bool:
    """Whether the subschemas that can apply to an item say no more of a string than a
    ``minLength``, and at most one ``pattern`` (any number of subschemas may repeat it) every
    prefix of whose strings has infinitely many completions: a repeat can then always be
    written on past (``^[A-Za-z_][A-Za-z0-9_]*$``; not ``^[0-9]+x$``, done at its ``x``)."""
    patterns = {n["pattern"] for n in applying if "pattern" in n}
    if any(set(n) - _PLAIN_STRING - {"pattern"} for n in applying) or len(patterns) > 1:
        return False
    return all(isinstance(p, str) and unbounded_completions(p) is True for p in patterns)


def _open_string_items(root: dict, path: Path) -> bool:
    """Whether every item of an array at ``path`` is a string (``type: string``, or listed
    strings), and the strings each ``items`` subschema takes include every string past some
    length: a plain string, perhaps with a ``minLength``, as one branch of every union it sits
    in, listed strings beside it (``anyOf: [{type: string}, {enum: ["activeTab", ...]}]``,
    MaskBench JsonSchemaStore webextension). Every prefix of an item then goes on into endless
    strings: a repeat can always be written on past."""
    if not _forces(root, root, (*path, None), lambda n: _strings_only(root, n, 0), None, {}):
        return False
    found = False
    for node in _applying(root, path):
        if any(node.get(k) is not None for k in ("prefixItems", "additionalItems", "unevaluatedItems", "contains")):
            return False
        items = node.get("items")
        if items is not None:
            if not _endless_strings(root, items, 0):
                return False
            found = True
    return found


_OPEN_STRING_KEYS = _STRUCTURAL | {"type", "minLength", "anyOf"}


def _endless_strings(root: dict, node: Any, depth: int) -> bool:
    """Whether ``node`` takes every string past some length (an under-approximation)."""
    if node is True:
        return True
    if not isinstance(node, dict) or depth > 16 or set(node) - _OPEN_STRING_KEYS:
        return False
    if "type" in node and "string" not in (type_list(node["type"]) or ()):
        return False
    if "$ref" in node and not _endless_strings(root, _target(root, node["$ref"]), depth + 1):
        return False
    members = node.get("allOf", [])
    branches = node.get("anyOf")
    return isinstance(members, list) and all(_endless_strings(root, m, depth + 1) for m in members) and (
        branches is None or (isinstance(branches, list) and any(_endless_strings(root, b, depth + 1) for b in branches)))


def _strings_only(root: dict, node: Any, depth: int) -> bool:
    """Whether every value ``node`` takes is a string (an under-approximation)."""
    if node is False:
        return True
    if not isinstance(node, dict) or depth > 16:
        return False
    if type_list(node.get("type")) == ["string"]:
        return True
    listed = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
    if listed is not None and all(isinstance(v, str) for v in listed):
        return True
    if "$ref" in node and _strings_only(root, _target(root, node["$ref"]), depth + 1):
        return True
    if isinstance(node.get("allOf"), list) and any(_strings_only(root, m, depth + 1) for m in node["allOf"]):
        return True
    branches = node.get("anyOf")
    return isinstance(branches, list) and bool(branches) and all(_strings_only(root, b, depth + 1) for b in branches)


def _listed_strings(root: dict, path: Path, applying: list[dict]) -> tuple[str, ...] | bool | None:
    """The strings the items at ``path`` are listed among (``applying``: their subschemas), False
    when they are listed but too few for the items required, None when they are not listed
    strings."""
    if any(set(n) - _PLAIN_STRING - {"enum", "const"} or "anyOf" in n for n in applying):
        return None
    values: list | None = None
    for node in applying:
        listed = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
        if listed is not None:
            values = listed if values is None else [v for v in values if any(_same(v, w) for w in listed)]
        if type_list(node.get("type")) not in (None, ["string"]):
            return None
    low = max((n.get("minLength", 0) for n in applying if isinstance(n.get("minLength"), int)), default=0)
    fewest = max((n.get("minItems", 0) for n in _applying(root, path) if isinstance(n.get("minItems"), int)), default=0)
    if values is not None and any(type_list(n.get("type")) == ["string"] for n in applying):
        values = [v for v in values if isinstance(v, str)]
    if values is None or not all(isinstance(v, str) for v in values):
        return None
    strings = tuple(sorted({v for v in values if len(v) >= low}))
    return strings if len(strings) >= fewest else False  # else the array could run out of items


def _any_values(root: dict, path: Path) -> bool:
    """Every subschema that can apply to the value at ``path`` says at most its type, and some
    type it allows is unbounded (a repeat can be written on past: a longer string or number, one
    more key or item; ``true``, ``false`` and ``null`` are refused at their first letter once
    used)."""
    applying = list(_applying(root, path))
    if any(set(n) - _STRUCTURAL - {"type"} for n in applying):
        return False  # a union (anyOf / oneOf) is no conjunction of types either
    allowed = set(_UNBOUNDED_TYPES) | {"boolean", "null"}
    for node in applying:
        types = type_list(node.get("type")) if "type" in node else None
        if "type" in node and types is None:
            return False
        if types is not None:
            allowed &= set(types)
    return bool(allowed & _UNBOUNDED_TYPES)


def _open_objects(root: dict, path: Path) -> bool:
    """Every value at ``path`` is an object, and every subschema that can apply to it takes
    further keys (no closed, pattern-only or bounded key set; no listed values)."""
    if not _forces(root, root, path, lambda n: type_list(n.get("type")) == ["object"], None, {}):
        return False
    return all(not any(k in n for k in (*_CLOSING_KEYS, "maxProperties", "enum", "const"))
               and n.get("additionalProperties") is not False for n in _applying(root, path))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _counts_hold(root: dict, path: Path, low: int | None, high: int | None) -> bool:
    """Every object at ``path`` must meet the bounds, it takes any further key (for a minimum)
    and requires none (for a maximum)."""
    if low is not None and not _forces(root, root, path, lambda n: (_count(n.get("minProperties")) or 0) >= low,
                                       "object", {}):
        return False
    if high is not None and not _forces(
        root, root, path, lambda n: _count(n.get("maxProperties")) is not None and n["maxProperties"] <= high,
        "object", {}
    ):
        return False
    applying = list(_applying(root, path))
    closing = [n for n in applying if any(k in n for k in _CLOSING_KEYS) or n.get("additionalProperties") is False]
    if closing and (high is not None or len(closing) > 1 or not _endless_names(closing[0])):
        return False
    for node in applying:
        if high is not None and (node.get("required") or node.get("dependentRequired") or node.get("dependencies")):
            return False
    return True


def _endless_names(node: dict) -> bool:
    """Whether an object ``node`` closes still takes a further key whatever keys it has: a
    ``patternProperties`` pattern matches infinitely many names past any prefix (a map of
    ``^[a-z0-9-]+$`` names) and takes some value there; no ``propertyNames`` /
    ``unevaluatedProperties`` beside."""
    patterns = node.get("patternProperties")
    if set(_CLOSING_KEYS).intersection(node) - {"patternProperties"} or not isinstance(patterns, dict):
        return False
    return any(isinstance(p, str) and value is not False and unbounded_completions(p) is True
               for p, value in patterns.items())


def _target(root: dict, ref: Any) -> Any:
    """The subschema a local ``$ref`` names, or None."""
    return at_pointer(root, ref[1:]) if isinstance(ref, str) and ref.startswith("#") else None


def _admits(node: dict, kind: str | None) -> bool:
    types = type_list(node.get("type"))
    return kind is None or types is None or kind in types


def _forces(root: dict, node: Any, path: Path, holds: Callable[[dict], bool], kind: str | None, seen: dict) -> bool:
    """Whether every instance valid under ``node`` whose value at ``path`` exists (and is a
    ``kind``, when one is named) has that value satisfy ``holds`` in some subschema it must
    meet. Conservative: False where it cannot tell. ``seen`` remembers each (subschema, path)
    answer: a subschema reached again through another branch (two ``oneOf`` branches referring
    to one definition) answers as it did, one reached again inside itself (a recursion) False."""
    if node is False:
        return True
    if not isinstance(node, dict):
        return False
    key = (id(node), path)
    if key in seen:
        return seen[key]
    if len(seen) > MAX_VISITS:
        return False
    seen[key] = False  # until answered: a recursion proves nothing
    seen[key] = _forces_here(root, node, path, holds, kind, seen)
    return seen[key]


def _forces_here(root: dict, node: dict, path: Path, holds: Callable[[dict], bool], kind: str | None,
                 seen: dict) -> bool:
    step_kind = kind if not path else ("array" if path[0] is None else "object")
    if not _admits(node, step_kind):
        return True  # no such value under this node
    if (path and _step_forces(root, node, path, holds, kind, seen)) or (not path and holds(node)):
        return True
    if "$ref" in node:
        target = _target(root, node["$ref"])
        if target is not None and _forces(root, target, path, holds, kind, seen):
            return True
    if any(_forces(root, m, path, holds, kind, seen) for m in node.get("allOf") or []):
        return True
    for keyword in ("anyOf", "oneOf"):
        branches = node.get(keyword)
        if isinstance(branches, list) and branches and all(_forces(root, b, path, holds, kind, seen) for b in branches):
            return True
    return "if" in node and all(_forces(root, node.get(k, True), path, holds, kind, seen) for k in ("then", "else"))


def _step_forces(root: dict, node: dict, path: Path, holds, kind: str | None, seen: dict) -> bool:
    head, rest = path[0], path[1:]
    if head is None:
        items = node.get("items")
        return isinstance(items, (dict, bool)) and "prefixItems" not in node and _forces(root, items, rest, holds, kind, seen)
    props = node.get("properties")
    if isinstance(head, str) and isinstance(props, dict) and head in props:
        return _forces(root, props[head], rest, holds, kind, seen)
    patterns = node.get("patternProperties")
    if isinstance(head, PatternKey) and isinstance(patterns, dict) and list(patterns) == [head.pattern]:
        return _forces(root, patterns[head.pattern], rest, holds, kind, seen)
    if patterns:
        return False  # a pattern may or may not take the key
    extra = node.get("additionalProperties", True)
    return extra is False or (isinstance(extra, dict) and _forces(root, extra, rest, holds, kind, seen))


def _applying(root: dict, path: Path) -> Iterator[dict]:
    """Every subschema (dict) that can apply to the value at ``path`` under some branch (a
    superset: conditions and alternatives all included; a key not listed brings in
    ``additionalProperties`` / ``patternProperties`` of its object)."""
    frontier: list[Any] = [root]
    for step in (*path, "end"):
        here = _in_place(root, frontier)
        if step == "end":
            yield from here
            return
        frontier = []
        for node in here:
            frontier.extend(_children_at(node, step))


def _in_place(root: dict, nodes: list[Any]) -> list[dict]:
    out: list[dict] = []
    seen: set[int] = set()
    stack = list(nodes)
    while stack and len(seen) < MAX_VISITS:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        if "$ref" in node:
            stack.append(_target(root, node["$ref"]))
        for keyword in _IN_PLACE_LISTS:
            stack.extend(node.get(keyword) or [])
        stack.extend(node[k] for k in (*_IN_PLACE_SINGLE, "if", "not") if k in node)
        deps = node.get("dependentSchemas") or node.get("dependencies")
        if isinstance(deps, dict):
            stack.extend(v for v in deps.values() if isinstance(v, dict))
    return out


def _children_at(node: dict, step: Any) -> list[Any]:
    if step is None:
        items = node.get("items")
        extra = [node.get(k) for k in ("additionalItems", "unevaluatedItems", "contains")]
        listed = items if isinstance(items, list) else [items]
        return [*listed, *(node.get("prefixItems") or []), *extra]
    props = node.get("properties")
    listed = isinstance(step, str) and isinstance(props, dict) and step in props
    out = [props[step]] if listed else []
    patterns = node.get("patternProperties")
    out.extend(patterns.values() if isinstance(patterns, dict) else [])
    out += [node.get("additionalProperties"), node.get("unevaluatedProperties")]
    return out


class _Walk:
    """Every subschema that holds a keyword this module checks, with the paths where it applies;
    ``unplaceable``: those also reached where a path cannot be told (opaque keywords, recursion)."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.nodes: dict[int, dict] = {}
        self.paths: dict[int, set[Path]] = {}
        self.unplaceable: set[int] = set()
        self._visits = 0
        self._applying: dict[Path, list[dict]] = {}

    def run(self) -> bool:
        try:
            self._visit(self.root, (), frozenset())
        except _GiveUp:
            return False
        self._mark_opaque()
        return True

    def _visit(self, node: Any, path: Path, stack: frozenset) -> None:
        if not isinstance(node, dict):
            return
        self._visits += 1
        if self._visits > MAX_VISITS:
            raise _GiveUp
        if id(node) in stack:
            self._mark_below(node)  # a recursion: paths without end
            return
        stack = stack | {id(node)}
        if node.get("uniqueItems") is True or "minProperties" in node or "maxProperties" in node or _many_properties(
                node) or _presence_bound(node):
            self.nodes[id(node)] = node
            self.paths.setdefault(id(node), set()).add(path)
        if "$ref" in node:
            target = _target(self.root, node["$ref"])
            if target is None:
                raise _GiveUp  # a reference this walk cannot follow
            self._visit(target, path, stack)
        for keyword in _IN_PLACE_LISTS:
            for member in node.get(keyword) or []:
                self._visit(member, path, stack)
        for keyword in _IN_PLACE_SINGLE:
            self._visit(node.get(keyword), path, stack)
        props = node.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                self._visit(sub, (*path, name), stack)
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and patterns:
            step = self._pattern_step(node, path)
            for sub in patterns.values():
                if step is None:
                    self._mark_below(sub)
                else:
                    self._visit(sub, (*path, step), stack)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            self._visit_other_keys(extra, props if isinstance(props, dict) else {}, path, stack)
        items = node.get("items")
        if isinstance(items, dict):
            self._visit(items, (*path, None), stack)
        elif isinstance(items, list):
            for sub in items:
                self._mark_below(sub)

    def _pattern_step(self, node: dict, path: Path) -> PatternKey | None:
        """The step to the keys ``node``'s ``patternProperties`` take at ``path``, where every
        key none of the subschemas there lists must match its one pattern (no other key is
        allowed; no listed key can match it, so none takes two subschemas); else None."""
        patterns = node["patternProperties"]
        if len(patterns) != 1 or node.get("additionalProperties") is not False:
            return None
        applying = self._applying.get(path)
        if applying is None:
            applying = self._applying[path] = list(_applying(self.root, path))
        if any(n is not node and n.get("patternProperties") for n in applying):
            return None
        (pattern,) = patterns
        listed = frozenset(k for n in applying if isinstance(n.get("properties"), dict) for k in n["properties"])
        if not all(isinstance(k, str) and _plain_key(k) and patterns_disjoint(_exact_pattern(k), pattern)
                   for k in listed):
            return None
        return PatternKey(listed, pattern)

    def _visit_other_keys(self, extra: dict, props: dict, path: Path, stack: frozenset) -> None:
        """``additionalProperties`` applies to the keys its object does not list: those another
        subschema at ``path`` lists (each by name) and every other key (one :class:`OtherKey`
        step); under a ``patternProperties`` no key can be told, and the subschema is placed
        nowhere."""
        applying = self._applying.get(path)
        if applying is None:
            applying = self._applying[path] = list(_applying(self.root, path))
        if any(n.get("patternProperties") for n in applying):
            self._mark_below(extra)
            return
        listed = frozenset(k for n in applying if isinstance(n.get("properties"), dict) for k in n["properties"])
        for name in sorted(listed - set(props)):
            self._visit(extra, (*path, name), stack)
        self._visit(extra, (*path, OtherKey(listed)), stack)

    def _mark_opaque(self) -> None:
        """Subschemas under opaque keywords (wherever they sit) cannot be placed on a path."""
        stack: list[Any] = [self.root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            for keyword in _OPAQUE:
                value = node.get(keyword)
                if isinstance(value, dict) and keyword in _MAP_OPAQUE:
                    subs: Any = value.values()
                else:
                    subs = value if isinstance(value, list) else [value]  # prefixItems: a list
                for sub in subs:
                    self._mark_below(sub)
            stack.extend(_all_children(node))

    def _mark_below(self, node: Any) -> None:
        """``node`` and everything it reaches (references followed) cannot be placed."""
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            if not isinstance(current, dict) or id(current) in seen:
                continue
            seen.add(id(current))
            self.unplaceable.add(id(current))
            if "$ref" in current:
                stack.append(_target(self.root, current["$ref"]))
            stack.extend(_all_children(current))


_MAP_OPAQUE = frozenset({"patternProperties", "dependentSchemas", "dependencies"})
# keywords that apply subschemas this module does not follow: a schema using them gets no checks
_UNFOLLOWED = frozenset({"$dynamicRef", "$recursiveRef", "extends", "disallow"})


# keywords whose value maps names to subschemas: the map itself is no schema (a property named
# ``not`` or ``dependencies`` is no keyword of it)
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})


def _all_children(node: dict) -> list[Any]:
    """Every dict inside ``node`` one or two levels down that may be a subschema: under a key
    no draft defines, both the value and its values (either may be a schema reached by
    ``$ref``); under a keyword that maps names to subschemas, only the subschemas."""
    out: list[Any] = []
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples", "required"):
            continue
        if isinstance(value, dict):
            if key not in _NAME_MAPS:
                out.append(value)
            out.extend(v for v in value.values() if isinstance(v, dict))
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, dict))
    return out


class _GiveUp(Exception):
    pass
