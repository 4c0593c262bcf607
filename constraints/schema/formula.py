"""A schema of one type read as a formula over that type's values, for a set solver
(:mod:`.number_sets`).

``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` / ``if``-``then``-``else`` and local ``$ref`` s are
read here; a solver's :class:`Algebra` gives the elements (for numbers, a test per number) and
their operations, and reads its own keywords. A keyword of another type says
nothing of these values and is skipped, as is a key no draft defines; a keyword the solver
does not read (or a recursion, or a formula past :data:`MAX_NODES` subschemas) stops the
reading (:class:`Unsolved`).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from .keywords import SPEC_KEYWORDS
from .tree import resolve

MAX_NODES = 2_000  # subschemas of one formula
_COMBINATORS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref"})
# keywords that speak of values of every type (or that this reader cannot follow): never skipped
_NEVER_VACUOUS = frozenset({"enum", "const", "$dynamicRef", "$recursiveRef", "disallow", "extends", "divisibleBy"})

E = TypeVar("E")


class Unsolved(Exception):
    """The schema says something the solver does not decide."""


class Algebra(Generic[E]):
    """The elements of one solver and how they combine."""

    # keywords of this type the algebra reads (``type`` is read by every algebra)
    keywords: frozenset[str] = frozenset()

    def everything(self) -> E:
        raise NotImplementedError

    def nothing(self) -> E:
        raise NotImplementedError

    def both(self, parts: list[E]) -> E:
        raise NotImplementedError

    def either(self, parts: list[E]) -> E:
        raise NotImplementedError

    def exactly_one(self, parts: list[E]) -> E:
        raise NotImplementedError

    def negated(self, part: E) -> E:
        raise NotImplementedError

    def choice(self, condition: E, then: E, otherwise: E) -> E:
        raise NotImplementedError

    def atom(self, key: str, value: Any) -> E:
        """The element of one keyword of :attr:`keywords` or ``type``."""
        raise NotImplementedError


def read(algebra: Algebra[E], schema: dict) -> tuple[E, "Reader[E]"] | None:
    """The element ``schema`` (a whole document) stands for in ``algebra``, and the reader that
    read it (whether it negated, how many subschemas); None where the solver stops."""
    reader = Reader(algebra, schema)
    try:
        return reader.formula(schema), reader
    except (Unsolved, RecursionError):
        return None


class Reader(Generic[E]):
    """Reads a schema document's formula in one algebra; ``negates`` tells whether it used
    ``not`` / ``oneOf`` / ``if`` (what the backends cannot take as written)."""

    def __init__(self, algebra: Algebra[E], root: dict) -> None:
        self.algebra = algebra
        self.root = root
        self.negates = False
        self.nodes = 0  # subschemas read so far
        self._active: set[int] = set()
        self._vacuous = SPEC_KEYWORDS - algebra.keywords - _COMBINATORS - _NEVER_VACUOUS - {"type"}

    def formula(self, node: Any) -> E:
        if isinstance(node, bool):
            return self.algebra.everything() if node else self.algebra.nothing()
        if not isinstance(node, dict):
            raise Unsolved
        self.nodes += 1
        if self.nodes > MAX_NODES or id(node) in self._active:
            raise Unsolved  # too large, or a recursion
        self._active.add(id(node))
        try:
            parts = [self._keyword(key, value, node) for key, value in node.items()]
        finally:
            self._active.discard(id(node))
        parts = [p for p in parts if p is not None]
        return self.algebra.both(parts) if parts else self.algebra.everything()

    def _keyword(self, key: str, value: Any, node: dict) -> E | None:
        if key in self._vacuous or key not in SPEC_KEYWORDS:  # an unknown key asserts nothing
            return None
        if key not in _COMBINATORS:
            if key != "type" and key not in self.algebra.keywords:
                raise Unsolved
            return self.algebra.atom(key, value)
        if key == "$ref":
            target = resolve({"$ref": value}, self.root) if isinstance(value, str) else None
            if not isinstance(target, (dict, bool)) or (isinstance(target, dict) and set(target) == {"$ref"}):
                raise Unsolved  # not a local reference that resolves
            return self.formula(target)
        if key in ("allOf", "anyOf", "oneOf"):
            if not isinstance(value, list) or not value:
                raise Unsolved
            parts = [self.formula(v) for v in value]
            if key == "allOf":
                return self.algebra.both(parts)
            if key == "anyOf":
                return self.algebra.either(parts)
            self.negates = True
            return self.algebra.exactly_one(parts)
        if key == "not":
            self.negates = True
            return self.algebra.negated(self.formula(value))
        if key == "if":
            self.negates = True
            everything = self.algebra.everything()
            then = self.formula(node["then"]) if "then" in node else everything
            otherwise = self.formula(node["else"]) if "else" in node else everything
            return self.algebra.choice(self.formula(value), then, otherwise)
        return None  # then / else: read with their if (alone they assert nothing)
