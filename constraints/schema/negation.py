"""A schema's negation, where it has an exact enforceable form: ``negate`` (``not``, ``oneOf`` as
"this branch and no other", the ``if`` of an ``if``/``then``/``else``), the strings a name schema
allows, and a regex for every string except some literals."""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any

from ..regex.analysis import finite_strings
from ..regex.complement import complement_pattern
from .disjoint import _disjoint
from .keywords import ALL_TYPES, FORMAT_ALIASES, SPEC_FORMATS, SPEC_KEYWORDS, meaningful, type_list
from .tree import resolve

MAX_COMPLEMENT_CHARS = 2_000  # literals negated into a regex
MAX_ONE_OF_NEGATED = 6
MAX_ONE_OF_PAIR_CHARS = 2_000  # a oneOf whose negation spells out pairs of its branches


def exactly_one(branches: list[Any], root: dict) -> Any:
    """oneOf as anyOf over "this branch and no other", when every branch can be negated."""
    if len(branches) > MAX_ONE_OF_NEGATED:
        return None
    negs = negate_all(branches, root)
    if any(n is None for n in negs):
        return None
    options = []
    for i, branch in enumerate(branches):
        option = all_of([branch, *(negs[j] for j in range(len(branches)) if j != i)])
        if option is not False:
            options.append(option)
    return {"anyOf": options} if options else False


def negate_all(schemas: list[Any], root: dict) -> list[Any]:
    """The negations of ``schemas``, in order, stopping at the first that has none (then the
    list is shorter, and holds a None last)."""
    out: list[Any] = []
    for schema in schemas:
        out.append(negate(schema, root))
        if out[-1] is None:
            break
    return out


def all_of(parts: list[Any]) -> Any:
    """The conjunction of ``parts``: False when one is False, ``{}`` when none says anything."""
    parts = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in parts):
        return False
    if not parts:
        return {}
    return parts[0] if len(parts) == 1 else {"allOf": parts}


# the subschemas whose negation is being computed (ids): one met again is a recursion
_NEGATING: ContextVar[frozenset[int]] = ContextVar("negating", default=frozenset())
# steps (subschemas negated) left to the outermost negation: references and nested oneOfs can
# make a negation as large as the whole schema, many times over
_BUDGET: ContextVar[list[int]] = ContextVar("negation_budget", default=[0])
MAX_NEGATION_STEPS = 2_000


def negate(schema: Any, root: dict) -> Any:
    """A schema accepting exactly the instances ``schema`` rejects, or None when not expressible.
    A recursive schema (a ``$ref`` leading back into a subschema being negated) has no finite
    negation: None, where following the cycle would exhaust the stack (and, caught as a
    RecursionError, leave the whole schema unrewritten)."""
    schema = resolve(schema, root)
    active = _NEGATING.get()
    if id(schema) in active:
        return None
    if not active:  # a negation asked for from outside: a fresh budget of steps
        budget = _BUDGET.set([MAX_NEGATION_STEPS])
        try:
            return _negate_within_budget(schema, root, active)
        finally:
            _BUDGET.reset(budget)
    return _negate_within_budget(schema, root, active)


def _negate_within_budget(schema: Any, root: dict, active: frozenset[int]) -> Any:
    """:func:`negate` as one step of the budget the outermost call set (None once spent)."""
    left = _BUDGET.get()
    if left[0] <= 0:
        return None
    left[0] -= 1
    token = _NEGATING.set(active | {id(schema)}) if isinstance(schema, dict) else None
    try:
        return _negate(schema, root)
    finally:
        if token is not None:
            _NEGATING.reset(token)


def _negate(schema: Any, root: dict) -> Any:
    if schema is True:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return None
    s = meaningful(schema)
    if not s:
        return False
    if "$ref" in s:
        target = _ref_target(s["$ref"], root)
        if target is None:
            return None
        s = {**s, "$ref": target}  # negated below as one keyword among the others
    parts = []
    for key in list(s):
        neg = _negate_keyword(key, s, root)
        if neg is None:
            return None
        parts.append(neg)
    # not (A and B) = (not A) or (not B); keyword groups are handled together by _negate_keyword
    parts = [p for p in parts if p is not _SKIP]
    if any(p is True for p in parts):
        return True
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_SKIP = object()


def _negate_keyword(key: str, s: dict, root: dict) -> Any:
    value = s[key]
    if key == "type":
        types = type_list(value)
        if types is None:
            return None
        rest = [t for t in ALL_TYPES if t not in types and t != "integer"]
        if "integer" in types and "number" not in types:
            return None  # "number but not integer" needs multipleOf negation
        return {"type": rest} if rest else False
    if key == "required" and isinstance(value, list):
        if not value:
            return False
        return _only_objects([{"properties": {k: False}} for k in value])
    if key == "properties" and isinstance(value, dict):
        branches = []
        for name, sub in value.items():
            neg = negate(sub, root)
            if neg is None:
                return None
            if neg is not False:
                branches.append({"required": [name], "properties": {name: neg}})
        return _only_objects(branches) if branches else False
    if key == "pattern" and isinstance(value, str):  # strings it matches nowhere
        other = complement_pattern(value)
        return None if other is None else {"type": "string", "pattern": other}
    if key in ("const", "enum"):
        values = [value] if key == "const" else value
        if not isinstance(values, list):
            return None
        return _not_values(values)
    if key == "anyOf" and isinstance(value, list):
        negs = negate_all(value, root)
        if any(n is None for n in negs):
            return None
        return all_of(negs)
    if key == "allOf" and isinstance(value, list):
        negs = negate_all(value, root)
        if any(n is None for n in negs):
            return None
        negs = [n for n in negs if n is not False]
        if any(n is True for n in negs):
            return True
        return {"anyOf": negs} if negs else False
    if key == "oneOf" and isinstance(value, list):
        return _negate_one_of(value, root)
    if key == "$ref":  # the target, which _negate put in the reference's place
        return negate(value, root)
    if key == "not":  # double negation
        return value
    if key == "propertyNames":
        return _negate_property_names(value, root)
    if key == "patternProperties" and isinstance(value, dict):
        return _negate_pattern_properties(value, root)
    if key == "items" and isinstance(value, (dict, bool)) and "prefixItems" not in s:
        neg = negate(value, root)  # some item fails: contains the negation
        return None if neg is None else False if neg is False else {"type": "array", "contains": neg}
    if key == "contains" and not {"minContains", "maxContains"} & set(s):
        neg = negate(value, root)  # no item matches: every item fails
        return None if neg is None else {"type": "array", "items": neg}
    if key in _BOUND_NEGATIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _negate_bound(key, value)
    if key not in SPEC_KEYWORDS:  # no draft defines it: an annotation, true of every instance
        return _SKIP
    if key == "format" and isinstance(value, str) and FORMAT_ALIASES.get(value, value) not in SPEC_FORMATS:
        return _SKIP  # a name no draft defines asserts nothing (the rewrite drops it too)
    return None


def _negate_one_of(branches: list[Any], root: dict) -> Any:
    """not oneOf: no branch matches, or two do. Branches proven pairwise disjoint never
    match two at once (then it is not anyOf); else the pairs not proven disjoint are spelled
    out, for at most :data:`MAX_ONE_OF_NEGATED` branches."""
    negs = negate_all(branches, root)
    if any(n is None for n in negs):
        return None
    none_match = all_of(negs)
    pairs = [(a, b) for i, a in enumerate(branches) for b in branches[i + 1:] if not _disjoint(a, b, root)]
    if not pairs:
        return none_match
    if len(branches) > MAX_ONE_OF_NEGATED or _chars(branches) > MAX_ONE_OF_PAIR_CHARS:
        return None  # each pair copies two branches: kept small
    options = [o for o in (none_match, *(all_of([a, b]) for a, b in pairs)) if o is not False]
    if any(o is True or o == {} for o in options):
        return True
    return {"anyOf": options} if options else False


def _chars(value: Any) -> int:
    return len(json.dumps(value))


def _ref_target(ref: Any, root: dict) -> Any:
    """The subschema a local ``$ref`` leads to (followed through bare references), or None
    when it leads nowhere here. The keywords beside it apply too: normalisation dropped them
    in the drafts that ignore them."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target = resolve({"$ref": ref}, root)
    if isinstance(target, dict) and list(target) == ["$ref"]:
        return None  # unresolved
    return target


def finite_names(schema: Any, root: dict) -> list[str] | None:
    """The strings ``schema`` accepts, when they are few and known (``const`` / ``enum``, or a
    ``pattern`` anchored at both ends with a finite language), else None. Non-string values
    are left out: used for property names, which are strings."""
    schema = resolve(schema, root)
    if not isinstance(schema, dict):
        return [] if schema is False else None
    s = meaningful(schema)
    if s.get("type", "string") != "string":
        return None
    rest = set(s) - {"type", "const", "enum", "pattern"}
    if rest:
        return None
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list):
            return None
        names = [v for v in values if isinstance(v, str)]
        if "pattern" in s:
            import re

            try:
                names = [v for v in names if re.search(s["pattern"], v)]
            except re.error:
                return None
        return list(dict.fromkeys(names))
    if isinstance(s.get("pattern"), str):
        return finite_strings(s["pattern"])
    return None


def _negate_property_names(value: Any, root: dict) -> Any:
    """not {propertyNames: N}: an object with a name N rejects; expressible when the rejected
    names are few and known (N = false: any name; N = not X with X a finite name set)."""
    value = resolve(value, root)
    if value is False:
        return {"type": "object", "minProperties": 1}
    if value is True or not isinstance(value, dict):
        return False if value is True else None
    s = meaningful(value)
    if not s:
        return False
    if set(s) != {"not"}:
        return None
    names = finite_names(s["not"], root)
    if names is None:
        return None
    return _only_objects([{"required": [n]} for n in names])


def _negate_pattern_properties(value: dict, root: dict) -> Any:
    """not {patternProperties}: some property whose name matches a pattern has a value that
    pattern's schema rejects; expressible when each pattern names a few known strings."""
    branches = []
    for pattern, sub in value.items():
        names = finite_strings(pattern)
        neg = negate(sub, root)
        if names is None or neg is None:
            return None
        if neg is not False:
            branches.extend({"required": [n], "properties": {n: neg}} for n in names)
    return _only_objects(branches)


_BOUND_NEGATIONS = {
    "maxLength": ("string", "minLength", 1),
    "minLength": ("string", "maxLength", -1),
    "maxItems": ("array", "minItems", 1),
    "minItems": ("array", "maxItems", -1),
    "minimum": ("number", "exclusiveMaximum", 0),
    "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0),
    "exclusiveMaximum": ("number", "minimum", 0),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}


def _negate_bound(key: str, value: float) -> Any:
    """not {minLength: 3} = strings shorter than 3 (other types always satisfy the keyword)."""
    type_, other, shift = _BOUND_NEGATIONS[key]
    bound = value + shift
    if shift and (not float(value).is_integer() or bound < 0):
        return False if bound < 0 else None
    if other == "maxProperties" and bound == 0:  # the empty object, in a form backends enforce
        return {"type": "object", "additionalProperties": False}
    return {"type": type_, other: int(bound) if shift else value}


def _only_objects(branches: list[Any]) -> Any:
    # an object-keyword schema accepts every non-object, so its negation is objects only
    if not branches:
        return False
    inner = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {"type": "object", "allOf": [inner]}


def _not_values(values: list[Any]) -> Any:
    """Everything except the given literals (strings, booleans, null, integral numbers; not
    other numbers or containers)."""
    strings = [v for v in values if isinstance(v, str)]
    bools = {v for v in values if isinstance(v, bool)}
    numbers = [v for v in values if _is_number(v)]
    if any(not (v is None or isinstance(v, (str, bool)) or _is_number(v)) for v in values):
        return None
    if sum(len(v) for v in strings) > MAX_COMPLEMENT_CHARS:
        return None
    if not numbers:
        branches: list[Any] = [{"type": ["object", "array", "number"]}]
    elif (gaps := _number_gaps(numbers)) is not None:
        branches = [{"type": ["object", "array"]}, *gaps]
    else:
        return None
    if None not in values:
        branches.append({"type": "null"})
    if not bools:
        branches.append({"type": "boolean"})
    elif len(bools) == 1:
        branches.append({"enum": [not next(iter(bools))]})  # const is unknown to draft-04 (ignored there)
    if strings:
        branches.append({"type": "string", "pattern": "^" + complement_regex(strings) + "$"})
    else:
        branches.append({"type": "string"})
    return {"anyOf": branches}


MAX_EXCLUDED_NUMBERS = 64  # listed numbers a negation writes the gaps between
_SAFE_INTEGER = 2**53  # beyond it a double does not tell neighbouring integers apart


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_gaps(numbers: list[Any]) -> list[dict] | None:
    """Every number except the listed ones, as the open intervals between them (1 == 1.0, as
    JSON Schema compares numbers). Only integral values within ±2^53 (an exact bound for every
    backend), at most :data:`MAX_EXCLUDED_NUMBERS` of them; else None."""
    if len(numbers) > MAX_EXCLUDED_NUMBERS or not all(float(v).is_integer() and abs(v) <= _SAFE_INTEGER
                                                      for v in numbers):
        return None
    points = sorted({int(v) for v in numbers})
    gaps = [{"type": "number", "exclusiveMaximum": points[0]}]
    gaps.extend({"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} for lo, hi in zip(points, points[1:]))
    gaps.append({"type": "number", "exclusiveMinimum": points[-1]})
    return gaps


_CLASS_META = set("\\]^-[")
_REGEX_META = set("\\.+*?()|[]{}^$")
_ANY = r"[\s\S]"


def complement_regex(words: list[str]) -> str:
    """Regex (unanchored body) matching every string except the given ones."""
    trie: dict = {}
    for w in words:
        cur = trie
        for ch in w:
            cur = cur.setdefault(ch, {})
        cur[""] = {}
    return _complement(trie)


def _complement(node: dict) -> str:
    alts = []
    if "" not in node:
        alts.append("")
    kids = [c for c in node if c]
    if kids:
        cls = "".join("\\" + c if c in _CLASS_META else c for c in sorted(kids))
        alts.append(f"[^{cls}]{_ANY}*")
    else:
        alts.append(f"{_ANY}+")
    for c in sorted(kids):
        lit = "\\" + c if c in _REGEX_META else c
        alts.append(lit + _complement(node[c]))
    return "(?:" + "|".join(alts) + ")"
