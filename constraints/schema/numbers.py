"""Numeric keywords decided on exact decimals, and given to the backends only where they are exact.

A schema number is the decimal its JSON text spells: an integer exactly, at any size; a
non-integer number as Python's ``json`` parses it (a double), i.e. the shortest decimal that
reads back to that double (``repr``), which is also what the backends receive. Every decision
here is made on those decimals (:class:`fractions.Fraction`), never on binary floats:

* a node that only numbers of type ``integer`` reach gets its bounds as inclusive integers
  (``exclusiveMinimum: 2.5`` is ``minimum: 3``) and a fractional ``multipleOf`` as the integer it
  amounts to over the integers (``multipleOf: 0.5`` holds for every integer; ``2.5`` for the
  multiples of 5), unless that integer needs a grammar too large to compile in time;
* the backends read a bound, an ``enum`` or a ``const`` number through a double (llguidance)
  or a 64-bit integer (xgrammar): beyond ±2^53 - 2 it is rounded, and numbers it should exclude
  get through (``const: 12345678901234567890`` matched ``12345678901234567000``). Such a number
  is refused by name, except an integer bound that a double spells exactly (``10**16``,
  ``2**53 - 1``: llguidance then compares integers and decimals against it exactly, xgrammar lets
  no number past it but refuses some long decimals inside it) and, on an
  integer-only node, the 64-bit limits (``maximum: 2**63 - 1``, which llguidance saturates to).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

from ..errors import UnsupportedConstraintError

SAFE = 2**53 - 2  # the largest magnitude every backend reads exactly (a double's integers, one step in)
MAX_SPELLED_PLACES = 6  # decimal steps longer than this (0.3333333333333333) keep their one spelling
MAX_MODULUS = 100_000  # states of an integer multipleOf grammar (llguidance: ~0.4 s there, 6 s at 10^6)
_INT64_LIMITS = (2**63 - 1, -(2**63))
_LOWER, _UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")
BOUNDS = _LOWER + _UPPER


def exact(value: Any) -> Fraction | None:
    """The exact value of a JSON number as Python parsed it (None: not a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return Fraction(value)
    return Fraction(Decimal(repr(value))) if math.isfinite(value) else None


def backend_exact(value: int) -> bool:
    """Whether the backends, reading integer ``value`` through a double, write it back as it is
    (every integer within :data:`SAFE`; beyond, those a double's shortest decimal spells:
    ``10**20`` but not ``2**60``)."""
    if abs(value) <= SAFE:
        return True
    if abs(value) >= 2**1023:
        return False
    as_float = float(value)
    return Fraction(Decimal(repr(as_float))) == value


def json_number(value: Fraction) -> int | float | None:
    """``value`` as the Python number ``json`` writes with exactly its decimal (an int when
    integral), or None when the backends would read it as another number."""
    if value.denominator == 1:
        return int(value) if backend_exact(int(value)) else None
    as_float = float(value)
    return as_float if Fraction(Decimal(repr(as_float))) == value else None


def is_multiple(value: Any, step: Any) -> bool | None:
    """Whether number ``value`` is an integer multiple of ``step``, on exact decimals (None:
    either is no finite number, or the step is not positive)."""
    v, d = exact(value), exact(step)
    if v is None or d is None or d <= 0:
        return None
    return (v / d).denominator == 1


def multiple_of_keyword(validator: Any, step: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's ``multipleOf`` decided by :func:`is_multiple` (jsonschema divides binary
    floats: 0.3 / 0.1 = 2.9999999999999996, so it calls 0.3 no multiple of 0.1)."""
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "number") and is_multiple(instance, step) is False:
        yield ValidationError(f"{instance!r} is not a multiple of {step!r}")


def integer_only(node: dict) -> bool:
    """Whether every number ``node`` allows must be an integer (its ``type`` says so)."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    return isinstance(types, list) and "integer" in types and "number" not in types


def rewrite_numbers(node: dict, where: Callable[[], str]) -> dict:
    """``node`` with its numeric keywords in the forms above; raises UnsupportedConstraintError
    naming a number no backend reads exactly (``where()``: the node's pointer, for the message)."""
    _check_listed(node, where)
    if any(isinstance(node.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        _check_bounds(node, where)  # draft-04's flags: left to the backends as written
        return node
    if not integer_only(node):
        _check_bounds(node, where)
        return node
    node = _integer_multiple(_integer_bounds(node))
    _check_bounds(node, where, integers=True)
    return node


def decimal_spellings(schema: Any) -> Any:
    """``schema`` (not modified) with each fractional ``multipleOf`` of two or more decimal
    places (0.25) also written at each coarser scale it spans (0.5): llguidance takes a multiple
    of 0.25 only with two decimals (``2.50``, not ``2.5`` or ``2.0``), so an ``anyOf`` of the
    steps lets every shorter spelling through. The same numbers, more ways to write them."""
    from .tree import subschemas

    if not any(isinstance(node, dict) and _coarser_steps(node) for _, node in subschemas(schema)):
        return schema
    copied = json.loads(json.dumps(schema))
    for node in [n for _, n in subschemas(copied) if isinstance(n, dict)]:  # before any is changed
        if steps := _coarser_steps(node):
            alternatives = {"anyOf": [{"multipleOf": node.pop("multipleOf")}, *({"multipleOf": s} for s in steps)]}
            if "anyOf" in node:
                node["allOf"] = [*node.get("allOf", []), alternatives]
            else:
                node.update(alternatives)
    return copied


def _coarser_steps(node: dict) -> list[int | float]:
    """The multiples of ``node``'s decimal ``multipleOf`` written with fewer decimals (the least
    common multiple of the step and 10^-j for each shorter scale j), as JSON numbers."""
    step = exact(node.get("multipleOf"))
    if step is None or step <= 0 or step.denominator == 1 or integer_only(node):
        return []
    if _coprime_part(step.denominator) != 1:
        return []  # no terminating decimal
    places = next(k for k in itertools.count() if 10**k % step.denominator == 0)
    if places < 2 or places > MAX_SPELLED_PLACES or step == Fraction(1, 10**places):
        return []  # 0.01: every decimal of up to two places, however many it writes
    steps = []
    for j in range(places - 1, 0, -1):  # (j = 0 would be an integer step: integers are spelled without decimals)
        coarser = _lcm(step, Fraction(1, 10**j))
        if coarser != step and coarser.denominator != 1 and (written := json_number(coarser)) is not None \
                and written not in steps:
            steps.append(written)
    return steps


def _lcm(a: Fraction, b: Fraction) -> Fraction:
    return Fraction(math.lcm(a.numerator, b.numerator), math.gcd(a.denominator, b.denominator))


def _integer_bounds(node: dict) -> dict:
    """Bounds of an integer-only node as one inclusive integer ``minimum`` / ``maximum``."""
    if not any(exact(node.get(k)) is not None for k in BOUNDS):
        return node
    lows = [math.ceil(v) if k == "minimum" else math.floor(v) + 1
            for k in _LOWER if (v := exact(node.get(k))) is not None]
    highs = [math.floor(v) if k == "maximum" else math.ceil(v) - 1
             for k in _UPPER if (v := exact(node.get(k))) is not None]
    out = {k: v for k, v in node.items() if k not in BOUNDS or exact(v) is None}
    if lows:
        out["minimum"] = max(lows)
    if highs:
        out["maximum"] = min(highs)
    return out


def _integer_multiple(node: dict) -> dict:
    """A fractional ``multipleOf`` over the integers: n / (p/q) is an integer exactly when p
    divides n (p/q in lowest terms), so it is ``multipleOf: p`` (none when p is 1)."""
    step = exact(node.get("multipleOf"))
    if step is None or step <= 0 or step.denominator == 1 or _coprime_part(step.numerator) > MAX_MODULUS:
        return node  # an integer already, or a modulus no backend compiles in time: left as written
    node = dict(node)
    if step.numerator == 1:
        del node["multipleOf"]
    else:
        node["multipleOf"] = step.numerator
    return node


def _coprime_part(n: int) -> int:
    """``n`` without its factors 2 and 5 (the states a decimal "multiple of n" grammar needs)."""
    for p in (2, 5):
        while n % p == 0:
            n //= p
    return n


def _check_listed(node: dict, where: Callable[[], str]) -> None:
    """Refuse an ``enum`` / ``const`` holding (at any depth) an integer the backends would
    read as another number."""
    for key in ("enum", "const"):
        stack = list(node[key]) if key == "enum" and isinstance(node.get(key), list) else \
            [node[key]] if key == "const" and key in node else []
        while stack:
            value = stack.pop()
            if isinstance(value, (dict, list)):
                stack.extend(value.values() if isinstance(value, dict) else value)
            elif isinstance(value, int) and not isinstance(value, bool) and not backend_exact(value):
                raise _refusal(key, where, f"{value!r} lies beyond ±2^53, where the backends read"
                                           " numbers as doubles (it would match another number)")


def _check_bounds(node: dict, where: Callable[[], str], integers: bool = False) -> None:
    for key in BOUNDS:
        value = node.get(key)
        if exact(value) is None or abs(exact(value)) <= SAFE:
            continue
        if isinstance(value, int) and (backend_exact(value) or (integers and value in _INT64_LIMITS)):
            continue
        kind = "integer" if integers else "number"
        raise _refusal(key, where, f"{value!r} lies beyond ±2^53, where the backends compare {kind}s"
                                   " through rounded doubles")


def _refusal(key: str, where: Callable[[], str], why: str) -> UnsupportedConstraintError:
    at = where()
    return UnsupportedConstraintError(f"keyword {key!r} at {at or '/'} is not supported for enforcement: {why}",
                                      pointer=f"{at}/{key}", keyword=key)
