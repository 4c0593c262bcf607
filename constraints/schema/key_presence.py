"""Which keys an object holds, as a formula the matcher checks while the keys come in any order.

A schema often binds an object's keys by presence alone: ``oneOf: [{required: [radius]},
{required: [length, width]}]`` ("exactly one of these shapes"), the rewrite of such a ``oneOf``
into "this branch and not the others" (``{properties: {radius: false}}`` says "no radius"), or a
``not: {required: [a, b]}``. When :mod:`constraints.schema.runtime_checks` writes an object's
listed properties in any order, such subschemas would otherwise pin it to the declared order
(the backend cannot combine them with order-free keys). :func:`presence_formula` reads one as a
boolean formula over "key k is present"; :class:`KeyPresence` lists the key sets that satisfy
all of them (few keys are named, so they are enumerated once at compile time) and answers the
matcher's two questions:

* may a key be written now (some satisfying set holds every key written so far and it)?
* may the object close now (the keys written so far are a satisfying set)?

From any state reached this way a satisfying set holds what was written, and its missing keys
can be written one by one (each listed key can come at any point of an order-free object), so
the answer never gets stuck.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Iterable

from .keywords import ANNOTATIONS, type_list

MAX_PRESENCE_KEYS = 12  # keys one object's formulas may name (their sets are enumerated)

# ("has", key) | ("lacks", key) | ("type", types) | ("not", Formula) | (combinator, tuple[Formula, ...])
Formula = tuple
TRUE: Formula = ("allOf", ())
FALSE: Formula = ("anyOf", ())
_COMBINATORS = ("allOf", "anyOf", "oneOf")
NON_OBJECT_TYPES = ("null", "boolean", "array", "string", "number", "integer")


def presence_formula(part: Any, listed: dict | None = None) -> Formula | None:
    """``part`` (a subschema) as a formula over an object's keys' presence, or None when it says
    anything else: only ``required``, ``properties`` whose values are ``false`` (the key is
    absent) or say no more than the object's own ``listed`` properties do (``{"properties":
    {"path": {"type": "string"}}}`` beside a ``path`` listed as a string), ``type``,
    annotations, and ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` over such subschemas."""
    if part is True:
        return TRUE
    if part is False:
        return FALSE
    if not isinstance(part, dict):
        return None
    clauses: list[Formula] = []
    for key, value in part.items():
        if key in ANNOTATIONS:
            continue
        clause = _keyword_formula(key, value, listed or {})
        if clause is None:
            return None
        clauses.append(clause)
    return clauses[0] if len(clauses) == 1 else ("allOf", tuple(clauses))


def _keyword_formula(key: str, value: Any, listed: dict) -> Formula | None:
    if key == "type":
        types = type_list(value)
        return None if types is None else ("type", frozenset(types))
    if key == "required" and isinstance(value, list) and all(isinstance(k, str) for k in value):
        return ("allOf", tuple(("has", k) for k in value))
    if key == "properties" and isinstance(value, dict):
        absent = []
        for name, sub in value.items():
            if sub is False or _excluded(sub, listed.get(name)):
                absent.append(name)  # met only when the key is not there
            elif not _implied(sub, listed.get(name)):
                return None
        return ("allOf", tuple(("lacks", k) for k in absent))
    if key in _COMBINATORS and isinstance(value, list) and value:
        members = [presence_formula(v, listed) for v in value]
        return None if any(m is None for m in members) else (key, tuple(members))
    if key == "not":
        inner = presence_formula(value, listed)
        return None if inner is None else ("not", inner)
    return None


def _excluded(value: Any, own: Any) -> bool:
    """Whether no value the object's own property schema ``own`` takes meets ``value``: their
    types do not meet (``{"type": ["null", "number"]}`` beside a string property)."""
    said, holds_own = _types_only(value), _own_types(own)
    if said is None or holds_own is None:
        return False
    widened = said | ({"integer"} if "number" in said else set())
    return not (holds_own & widened) and not ("number" in holds_own and "integer" in said)


def _types_only(value: Any) -> set[str] | None:
    if not isinstance(value, dict) or set(value) - ANNOTATIONS != {"type"}:
        return None
    types = type_list(value["type"])
    return set(types) if types is not None else None


def _own_types(own: Any) -> set[str] | None:
    types = type_list(own.get("type")) if isinstance(own, dict) and "type" in own else None
    return set(types) if types is not None else None


def _implied(value: Any, own: Any) -> bool:
    """Whether every value the object's own property schema ``own`` takes meets ``value``."""
    if value is True or value == {} or (own is not None and value == own):
        return True
    if not isinstance(value, dict) or not isinstance(own, dict) or set(value) - ANNOTATIONS != {"type"}:
        return False
    said, holds_own = type_list(value["type"]), type_list(own.get("type"))
    return said is not None and holds_own is not None and set(holds_own) <= set(said) | (
        {"integer"} if "number" in said else set())


def holds(formula: Formula, present: frozenset) -> bool:
    """Whether an object holding exactly the keys ``present`` satisfies ``formula``."""
    return _evaluate(formula, lambda leaf, arg: arg in present if leaf == "has" else arg not in present
                     if leaf == "lacks" else "object" in arg)


def holds_for(formula: Formula, kind: str) -> bool:
    """Whether a value of type ``kind`` (not an object; ``number``: not an integer) satisfies
    ``formula`` (``required`` and ``properties`` say nothing of it)."""
    return _evaluate(formula, lambda leaf, arg: leaf != "type" or kind in arg or (
        kind == "integer" and "number" in arg))


def _evaluate(formula: Formula, leaf_value: Any) -> bool:
    op, arg = formula
    if op in ("has", "lacks", "type"):
        return leaf_value(op, arg)
    if op == "not":
        return not _evaluate(arg, leaf_value)
    if op == "allOf":
        return all(_evaluate(f, leaf_value) for f in arg)
    if op == "anyOf":
        return any(_evaluate(f, leaf_value) for f in arg)
    return sum(_evaluate(f, leaf_value) for f in arg) == 1


def named_keys(formula: Formula) -> set[str]:
    """The keys ``formula`` speaks of."""
    op, arg = formula
    if op in ("has", "lacks"):
        return {arg}
    if op == "type":
        return set()
    if op == "not":
        return named_keys(arg)
    return set().union(*(named_keys(f) for f in arg)) if arg else set()


def binds_keys(formula: Formula) -> bool:
    """Whether ``formula`` speaks of any key (a bare ``type`` does not)."""
    return bool(named_keys(formula))


def dependency_formula(name: str, needed: Iterable[str]) -> Formula:
    """"When ``name`` is present, so are ``needed``"."""
    return ("anyOf", (("lacks", name), ("allOf", tuple(("has", k) for k in (name, *needed)))))


def other_types(formulas: list[Formula]) -> tuple[str, ...] | None:
    """The types besides object whose values satisfy every formula, or None when that set
    names non-integer numbers without integers (no ``type`` list says it)."""
    kinds = tuple(t for t in NON_OBJECT_TYPES if all(holds_for(f, t) for f in formulas))
    return None if "number" in kinds and "integer" not in kinds else kinds


@dataclass(frozen=True)
class KeyPresence:
    """The key sets (among ``keys``) an object may hold; its other keys are free."""

    keys: frozenset
    allowed: frozenset  # frozensets of keys

    @classmethod
    def of(cls, formulas: list[Formula], writable: set[str]) -> "KeyPresence | None":
        """The sets of keys satisfying every formula, each made of ``writable`` keys only; None
        when they name too many keys, or a key that is not writable is needed, or no set
        satisfies them (the object admits nothing: left to the rest of the compiler)."""
        formula: Formula = ("allOf", tuple(formulas))
        keys = named_keys(formula)
        if len(keys) > MAX_PRESENCE_KEYS:
            return None
        choices = sorted(keys & writable)
        allowed = frozenset(
            present for n in range(len(choices) + 1) for chosen in itertools.combinations(choices, n)
            if holds(formula, present := frozenset(chosen)))
        return cls(frozenset(keys), allowed) if allowed else None

    def complete(self, seen: frozenset) -> bool:
        """Whether an object holding ``seen`` (any keys) may close."""
        return (seen & self.keys) in self.allowed

    def admits(self, seen: frozenset, key: str) -> bool:
        """Whether ``key`` may be written after ``seen``: some allowed set holds both."""
        return key not in self.keys or key in _reachable(self, seen & self.keys)

    def refused(self, seen: frozenset) -> list[str]:
        """The keys that may not be written after ``seen``."""
        reachable = _reachable(self, seen & self.keys)
        return sorted(k for k in self.keys if k not in seen and k not in reachable)


@functools.lru_cache(maxsize=4096)
def _reachable(presence: KeyPresence, held: frozenset) -> frozenset:
    """The keys of the allowed sets that hold ``held`` (a key is admitted exactly when it is
    among them): computed once per state, as the matcher asks at every mask."""
    return frozenset().union(*(present for present in presence.allowed if held <= present))
