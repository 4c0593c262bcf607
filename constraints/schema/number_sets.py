"""Schemas about numbers alone, solved exactly as sets of numbers and written back plainly.

A schema whose keywords all speak of numbers (``type``, bounds, ``multipleOf``, ``enum`` /
``const`` of numbers) combined by ``allOf`` / ``anyOf`` / ``oneOf`` / ``not`` / ``if``-``then``-
``else`` and ``$ref`` describes a set of numbers that is simple whatever the combination: each
keyword is decided by where a number lies between the bound points and by its residue on the
lattice the moduli span. So the set is computed here, by evaluating the formula exactly
(:class:`fractions.Fraction`) at one point of each kind, and written back as an ``anyOf`` of
plain pieces the backends enforce: ``{"type": "number"}`` or ``{"type": "integer",
"multipleOf": d}`` between two bounds, and the listed numbers where a stretch holds few of them.
``not`` over ``multipleOf`` (MaskBench Handwritten allany, allone, num) had no exact form before.

* The lattice is the multiples of ``g``, the greatest common divisor of 1 and every modulus
  (rationals: ``gcd(1, 2.5) = 0.5``); every keyword is periodic on it with period ``P``, their
  least common multiple. A number off the lattice is a multiple of no modulus and no integer, so
  every such number in one stretch between bound points is decided alike.
* A stretch the bounds alone decide (the formula read with its lattice keywords undecided, in
  three-valued logic) is empty or "every number" there. Otherwise a stretch whose off-lattice
  numbers are in the set must hold every lattice number too (then "every number" again); one
  whose off-lattice numbers are out is written as the residue classes ``d·Z`` (``g = 1``) whose
  union is exactly its set, or listed when it holds at most :data:`MAX_LISTED` lattice numbers.
  A number piece is bounded only by integers within ±2^53 (the bounds every backend compares
  exactly). Anything else is left to the other rewrites (None).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable

from .formula import Algebra, Unsolved, read
from .keywords import type_list
from .numbers import SAFE, exact, json_number

MAX_LISTED = 1_000  # lattice numbers a finite stretch may list
MAX_PERIOD = 10_000  # residues of one period examined
MAX_EVALUATIONS = 2_000_000  # residues examined times the formula's subschemas (each a Python call)
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})

Test = Callable[[Fraction, bool], "bool | None"]  # (x, vague): vague leaves lattice keywords undecided (None)


def numbers_only(schema: Any) -> Any | None:
    """``schema`` (normalised, the whole document) rewritten as plain pieces when it admits
    numbers alone and says only what :mod:`.number_sets` decides; None otherwise (nothing to do,
    or no plain form)."""
    if not isinstance(schema, dict) or "type" not in schema \
            or not set(type_list(schema["type"]) or ["?"]) <= {"number", "integer"}:
        return None
    algebra = _Numbers()
    found = read(algebra, schema)
    if found is None:
        return None
    test, reader = found
    if not reader.negates:
        return None  # the backends (and the other rewrites) take it as it is
    try:
        pieces = _pieces(_counted(test, MAX_EVALUATIONS // reader.nodes), sorted(algebra.points), algebra.moduli)
    except Unsolved:
        return None
    if pieces is None:
        return None
    return {"anyOf": pieces} if pieces else False


class _Numbers(Algebra[Test]):
    """Numbers: each element a three-valued test; the bound and listed points and the moduli
    are collected as the keywords are read."""

    keywords = _NUMERIC | {"enum", "const"}

    def __init__(self) -> None:
        self.points: set[Fraction] = set()
        self.moduli: set[Fraction] = set()

    def everything(self) -> Test:
        return lambda x, vague: True

    def nothing(self) -> Test:
        return lambda x, vague: False

    def both(self, parts: list[Test]) -> Test:
        return lambda x, vague: _all(p(x, vague) for p in parts)

    def either(self, parts: list[Test]) -> Test:
        return lambda x, vague: _any(p(x, vague) for p in parts)

    def exactly_one(self, parts: list[Test]) -> Test:
        return lambda x, vague: _one([p(x, vague) for p in parts])

    def negated(self, part: Test) -> Test:
        return lambda x, vague: _not(part(x, vague))

    def choice(self, condition: Test, then: Test, otherwise: Test) -> Test:
        return lambda x, vague: _if(condition(x, vague), then(x, vague), otherwise(x, vague))

    def atom(self, key: str, value: Any) -> Test:
        if key == "type":
            return self._type(value)
        if key in ("enum", "const"):
            return self._listed(value if key == "enum" else [value], key == "enum")
        return self._numeric(key, value)

    @staticmethod
    def _type(value: Any) -> Test:
        names = type_list(value)
        if names is None:
            raise Unsolved
        if "number" in names:
            return lambda x, vague: True
        if "integer" in names:
            return lambda x, vague: None if vague else x.denominator == 1
        return lambda x, vague: False

    def _numeric(self, key: str, value: Any) -> Test:
        bound = exact(value)
        if bound is None:
            raise Unsolved
        if key == "multipleOf":
            if bound <= 0:
                raise Unsolved
            self.moduli.add(bound)
            return lambda x, vague: None if vague else (x / bound).denominator == 1
        self.points.add(bound)
        return {"minimum": lambda x, vague: x >= bound, "maximum": lambda x, vague: x <= bound,
                "exclusiveMinimum": lambda x, vague: x > bound, "exclusiveMaximum": lambda x, vague: x < bound}[key]

    def _listed(self, values: Any, many: bool) -> Test:
        if many and not isinstance(values, list):
            raise Unsolved
        numbers = [exact(v) for v in values]
        if any(n is None for n in numbers):
            raise Unsolved  # a listed value that is no number: not a formula of numbers alone
        self.points.update(numbers)
        listed = frozenset(numbers)
        return lambda x, vague: x in listed  # a stretch between the points holds none of them


def _all(values) -> bool | None:
    """Three-valued "and": False wins, then undecided (None)."""
    unknown = False
    for v in values:
        if v is False:
            return False
        unknown = unknown or v is None
    return None if unknown else True


def _any(values) -> bool | None:
    """Three-valued "or", as "not all not"."""
    return _not(_all(_not(v) for v in values))


def _one(values: list) -> bool | None:
    sure, unknown = values.count(True), values.count(None)
    if sure > 1:
        return False
    if unknown:
        return None
    return sure == 1


def _not(value: bool | None) -> bool | None:
    return None if value is None else not value


def _if(condition: bool | None, then: bool | None, otherwise: bool | None) -> bool | None:
    if condition is None:
        return then if then == otherwise else None
    return then if condition else otherwise


def _lattice(moduli: set[Fraction]) -> tuple[Fraction, Fraction]:
    """(g, P): the gcd and lcm of 1 and the moduli, as rationals."""
    g, period = Fraction(1), Fraction(1)
    for m in moduli:
        g = Fraction(math.gcd(g.numerator * m.denominator, m.numerator * g.denominator), g.denominator * m.denominator)
        period = Fraction(math.lcm(period.numerator * m.denominator, m.numerator * period.denominator),
                          period.denominator * m.denominator)
    return g, period


def _counted(test: Test, budget: int) -> Test:
    """``test``, raising :class:`Unsolved` once it has been evaluated ``budget`` times."""
    left = [budget]

    def counted(x: Fraction, vague: bool) -> bool | None:
        left[0] -= 1
        if left[0] < 0:
            raise Unsolved
        return test(x, vague)

    return counted


def _pieces(test: Test, points: list[Fraction], moduli: set[Fraction]) -> list[dict] | None:
    """The set ``test`` admits as plain pieces, stretch by stretch between the points."""
    g, period = _lattice(moduli)
    steps = period / g
    pieces: list[dict] = []
    bounds = [None, *points, None]
    for low, high in zip(bounds, bounds[1:]):
        stretch = _stretch(test, low, high, g, int(steps) if steps <= MAX_PERIOD else None)
        if stretch is None:
            return None
        pieces += stretch
        if high is not None and test(high, False):
            number = json_number(high)
            if number is None:
                return None
            pieces.append({"const": number})
    return _merged(pieces)


def _stretch(test: Test, low: Fraction | None, high: Fraction | None, g: Fraction, steps: int | None) -> list[dict] | None:
    """The pieces of the open stretch (low, high) (an end None: unbounded); ``steps`` the
    lattice numbers in a period (None: too many to examine)."""
    if low is not None and high is not None and low >= high:
        return []
    inner = _inner_point(low, high)
    decided = test(inner, True)  # the bounds alone may decide the whole stretch
    if decided is not None:
        if not decided:
            return []
        piece = _between({"type": "number"}, low, high)
        return [piece] if piece is not None else None
    first = None if low is None else math.floor(low / g) + 1  # lattice indices strictly inside
    last = None if high is None else math.ceil(high / g) - 1
    count = None if first is None or last is None else max(0, last - first + 1)
    listable = count is not None and count <= MAX_LISTED
    if not listable and (steps is None or (count is not None and count < steps)):
        return None  # too many to list, too few (or too many kinds) to hold every residue
    lattice = [i * g for i in range(first, last + 1)] if listable else [
        _representative(r, low, high, g, steps) for r in range(steps)]
    off = _off_lattice(low, high, g)
    if off is not None and test(off, False):
        if not all(test(x, False) for x in lattice):
            return None
        piece = _between({"type": "number"}, low, high)
        return [piece] if piece is not None else None
    kept = [x for x in lattice if test(x, False)]
    if not kept:
        return []
    if listable:
        values = [json_number(x) for x in kept]
        return None if any(v is None for v in values) else [{"enum": values}]
    if g != 1:
        return None
    classes = _classes({int(x) % steps for x in kept}, steps)
    if classes is None:
        return None
    # for integers, x > 2.5 is x > 2: integral bounds, which every backend compares exactly
    low, high = (None if low is None else Fraction(math.floor(low))), (None if high is None else Fraction(math.ceil(high)))
    pieces = [_between({"type": "integer"} | ({"multipleOf": d} if d > 1 else {}), low, high) for d in classes]
    return None if any(p is None for p in pieces) else pieces


def _inner_point(low: Fraction | None, high: Fraction | None) -> Fraction:
    """Some number strictly inside (low, high)."""
    if low is None and high is None:
        return Fraction(0)
    if low is None:
        return high - 1
    if high is None:
        return low + 1
    return (low + high) / 2


def _off_lattice(low: Fraction | None, high: Fraction | None, g: Fraction) -> Fraction | None:
    """A number strictly inside (low, high) that is no multiple of ``g`` (None: none there)."""
    if low is None and high is None:
        base, width = Fraction(0), Fraction(1)
    elif low is None:
        base, width = high - 1, Fraction(1)
    elif high is None:
        base, width = low, Fraction(1)
    else:
        base, width = low, high - low
    for k in (997, 1009, 1013):
        x = base + width / k
        if (x / g).denominator != 1 and (low is None or x > low) and (high is None or x < high):
            return x
    return None


def _representative(residue: int, low: Fraction | None, high: Fraction | None, g: Fraction, steps: int) -> Fraction:
    """A lattice number ``i·g`` with ``i ≡ residue (mod steps)`` strictly inside a stretch that
    holds more than a period of them (or is unbounded)."""
    if low is not None:
        start = math.floor(low / g) + 1
    elif high is not None:
        start = math.ceil(high / g) - 1 - 2 * steps
    else:
        start = 0
    i = start + (residue - start) % steps
    return i * g


def _classes(residues: set[int], steps: int) -> list[int] | None:
    """Divisors d of ``steps`` whose multiples (mod steps) together are exactly ``residues``."""
    divisors = [d for d in range(1, steps + 1) if steps % d == 0 and all(r in residues for r in range(0, steps, d))]
    chosen = [d for d in divisors if not any(e != d and d % e == 0 for e in divisors)]  # the coarsest ones
    covered = {r for d in chosen for r in range(0, steps, d)}
    return chosen if covered == residues else None


def _between(piece: dict, low: Fraction | None, high: Fraction | None) -> dict | None:
    """``piece`` confined to the open stretch (None: a bound not every backend compares exactly:
    only integers within ±2^53 are, as :mod:`.negation` writes the gaps between numbers)."""
    for key, bound in (("exclusiveMinimum", low), ("exclusiveMaximum", high)):
        if bound is not None:
            number = json_number(bound) if bound.denominator == 1 and abs(bound) <= SAFE else None
            if number is None:
                return None
            piece[key] = number
    return piece


def _merged(pieces: list[dict]) -> list[dict]:
    """Consecutive listed pieces as one ``enum``."""
    out: list[dict] = []
    for piece in pieces:
        listed = piece.get("enum", [piece["const"]] if "const" in piece else None)
        if listed is not None and out and "enum" in out[-1]:
            out[-1]["enum"] += listed
        elif listed is not None:
            out.append({"enum": list(listed)})
        else:
            out.append(piece)
    return out
