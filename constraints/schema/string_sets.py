"""Schemas about strings alone, solved exactly as one regular language and written as one pattern.

A schema of ``type: string`` whose keywords all speak of strings (``pattern``, ``minLength`` /
``maxLength``, ``enum`` / ``const``) combined by ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` /
``if``-``then``-``else`` and ``$ref`` describes a regular language: each keyword is one (a
pattern's search language, ``[\\s\\S]{m,n}``, the listed strings), and the combinators are its
union, intersection and complement. The language is built as a DFA here (interegular, the
patterns as :mod:`constraints.regex.disjoint` reads them), minimised, and written back by state
elimination as one anchored pattern (:func:`constraints.regex.complement.written_pattern`, which
checks the pattern's own DFA against it), so the backend gets one regex in place of an
intersection of many. llguidance refused such intersections when it could not tell whether they
are empty (MaskBench Handwritten allany12-23, string1-2: "Unable to determine if regex is
empty"); an empty language is a 400 here, "no string satisfies the schema".

Only negating or multi-pattern formulas are solved (a plain pattern goes to the backends as it
is); a language whose DFA or pattern is too large, a ``format``, or any other keyword leaves the
schema to the other rewrites (None).
"""

from __future__ import annotations

from typing import Any

from ..regex.complement import trimmed, written_pattern
from ..regex.disjoint import pattern_language
from .formula import Algebra, Unsolved, read
from .keywords import type_list

MAX_STATES = 400  # states of an intermediate DFA (minimised)
MAX_LENGTH_BOUND = 48  # length bounds spelled out as DFAs (a bound of n takes n states)
_SPECIALS = frozenset("\\^$.|?*+()[]{}/")


def strings_only(schema: Any) -> Any | None:
    """``schema`` (normalised, the whole document) as ``{"type": "string", "pattern": …}`` when
    it admits strings alone, negates or intersects patterns, and says only what this module
    decides; False when no string satisfies it; None otherwise."""
    if not isinstance(schema, dict) or type_list(schema.get("type")) != ["string"]:
        return None
    solved = _solved(schema, {})
    if solved is None:  # the length bounds beside the pattern, not in it
        solved = _solved(*_hoisted_lengths(schema))
    return solved


def _solved(schema: dict, lengths: dict) -> Any | None:
    algebra = _Strings()
    found = read(algebra, schema)
    if found is None:
        return None
    language, reader = found
    if not reader.negates and algebra.patterns < 2:
        return None  # the backends take it as it is
    try:
        live = trimmed(language.reduce())
    except Exception:  # interegular gave up: nothing is promised
        return None
    if live is None:
        return False
    pattern = written_pattern(live)
    return None if pattern is None else {"type": "string", "pattern": pattern, **lengths}


def _hoisted_lengths(schema: dict) -> tuple[dict, dict]:
    """``schema`` without the length bounds that hold for every string it takes (its own, and
    ``allOf`` members that say nothing else), and those bounds (the tightest): they stay beside
    the pattern rather than in its DFA, where a bound of n takes n states."""
    lengths: dict[str, int] = {}

    def take(node: dict) -> dict:
        kept = dict(node)
        for key, pick in (("minLength", max), ("maxLength", min)):
            value = kept.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                lengths[key] = pick(lengths.get(key, value), kept.pop(key))
        return kept

    out = take(schema)
    members = out.get("allOf")
    if isinstance(members, list):
        bare = [m for m in members if isinstance(m, dict) and m and set(m) <= {"minLength", "maxLength"}]
        rest = [m for m in members if not any(m is b for b in bare)]
        for member in bare:
            take(member)
        if rest:
            out["allOf"] = rest
        else:
            del out["allOf"]
    return out, lengths


class _Strings(Algebra[Any]):
    """Strings: each element a DFA (interegular ``FSM``) over the whole string."""

    # format speaks of strings and is not read here: listed, so that the reader stops at it
    keywords = frozenset({"pattern", "minLength", "maxLength", "enum", "const", "format"})

    def __init__(self) -> None:
        self.patterns = 0
        self._everything = _whole("[\\s\\S]*")

    def everything(self) -> Any:
        return self._everything

    def nothing(self) -> Any:
        return _small(self._everything.everythingbut())

    def both(self, parts: list[Any]) -> Any:
        out = parts[0]
        for part in parts[1:]:
            out = _small(out & part)
        return out

    def either(self, parts: list[Any]) -> Any:
        out = parts[0]
        for part in parts[1:]:
            out = _small(out | part)
        return out

    def exactly_one(self, parts: list[Any]) -> Any:
        # in exactly one: in some, and in no two
        some = self.either(parts)
        pairs = [_small(a & b) for i, a in enumerate(parts) for b in parts[i + 1:]]
        return _small(some - self.either(pairs)) if pairs else some

    def negated(self, part: Any) -> Any:
        return _small(part.everythingbut())

    def choice(self, condition: Any, then: Any, otherwise: Any) -> Any:
        return self.either([self.both([condition, then]), self.both([self.negated(condition), otherwise])])

    def atom(self, key: str, value: Any) -> Any:
        if key == "type":
            names = type_list(value)
            if names is None:
                raise Unsolved
            return self.everything() if "string" in names else self.nothing()
        if key == "format":
            raise Unsolved
        if key == "pattern":
            if not isinstance(value, str):
                raise Unsolved
            self.patterns += 1
            return _language(value)  # the schema's patterns are ECMA-normalised already
        if key in ("minLength", "maxLength"):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LENGTH_BOUND:
                raise Unsolved
            return _whole("[\\s\\S]{%d,}" % value if key == "minLength" else "[\\s\\S]{0,%d}" % value)
        values = value if key == "enum" else [value]
        if not isinstance(values, list):
            raise Unsolved
        strings = [v for v in values if isinstance(v, str)]
        if not strings:
            return self.nothing()
        return _language("^(?:" + "|".join("".join("\\" + c if c in _SPECIALS else c for c in s)
                                             for s in strings) + ")$")


def _whole(body: str) -> Any:
    """The DFA of the whole strings ``body`` (interegular's syntax, no anchors) matches."""
    import interegular

    try:
        return _small(interegular.parse_pattern(body).to_fsm())
    except Unsolved:
        raise
    except Exception:
        raise Unsolved from None


def _language(pattern: str) -> Any:
    """The DFA of the strings ``pattern`` (ECMA-normalised, matched anywhere) accepts."""
    language = pattern_language(pattern)
    if language is None:
        raise Unsolved
    return _small(language)


def _small(fsm: Any) -> Any:
    try:
        fsm = fsm.reduce()
    except Exception:  # interegular gave up
        raise Unsolved from None
    if len(fsm.states) > MAX_STATES:
        raise Unsolved
    return fsm

