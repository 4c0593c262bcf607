"""Numeric keywords decided on exact decimals (constraints/schema/numbers.py): integer bounds and
fractional ``multipleOf`` over the integers rewritten exactly, bounds and listed numbers beyond
±2^53 refused by name (the backends round them through doubles) unless a double spells them,
multiples computed without floats."""

from __future__ import annotations

from fractions import Fraction

import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.schema.analysis import rewrite_schema
from constraints.schema.numbers import exact, is_multiple, json_number

from .conftest import walk_text


def _walker(compiler, tok, schema):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    return lambda text: walk_text(compiled, tok, text)


def test_numbers_are_the_decimals_their_text_spells():
    assert exact(0.1) == Fraction(1, 10) and exact(2**64 + 1) == 2**64 + 1
    assert exact(True) is None and exact(float("inf")) is None
    assert is_multiple(0.3, 0.1) and is_multiple(8.03, 0.01) and not is_multiple(0.31, 0.1)
    assert is_multiple(10**40, 0.5) and is_multiple(7, 0.5) is True
    assert json_number(Fraction(3, 10)) == 0.3 and json_number(Fraction(4)) == 4
    assert json_number(Fraction(1, 3)) is None


def test_integer_bounds_become_inclusive_integers():
    out = rewrite_schema({"type": "integer", "exclusiveMinimum": 2.5, "minimum": 1, "maximum": 10.7,
                          "exclusiveMaximum": 10})
    assert out == {"type": "integer", "minimum": 3, "maximum": 9}


def test_integer_bounds_are_enforced(compiler, tok):
    walk = _walker(compiler, tok, {"type": "integer", "exclusiveMinimum": 2.5, "maximum": 10.7})
    assert walk("3") and walk("10")
    assert not walk("2") and not walk("11")


def test_fractional_multiple_of_over_the_integers(compiler, tok):
    assert rewrite_schema({"type": "integer", "multipleOf": 0.5}) == {"type": "integer"}
    assert rewrite_schema({"type": "integer", "multipleOf": 1.5}) == {"type": "integer", "multipleOf": 3}
    walk = _walker(compiler, tok, {"type": "integer", "multipleOf": 2.5})  # multiples of 5
    assert walk("15") and walk("0") and not walk("12") and not walk("2")


def test_a_large_modulus_is_left_as_written():
    """Multiples of 123456789 would need a grammar of that many states: the fractional form is
    left for the backends to refuse (llguidance: "too many digits") or for a rewrite around it
    to decide (an enum beside it, say)."""
    assert rewrite_schema({"type": "integer", "multipleOf": 0.123456789})["multipleOf"] == 0.123456789
    schema = {"allOf": [{"enum": [7, 123456789]}, {"not": {"multipleOf": 0.123456789, "type": "integer"}}]}
    assert rewrite_schema(schema)["enum"] == [7]


def test_integer_bounds_a_double_spells_are_kept(compiler, tok):
    walk = _walker(compiler, tok, {"type": "integer", "maximum": 10**16, "minimum": -(2**53)})
    assert walk(str(10**16)) and walk(str(-(2**53))) and walk("0")
    assert not walk(str(10**16 + 1)) and not walk(str(-(2**53) - 1))


def test_the_int64_limits_are_exact(compiler, tok):
    walk = _walker(compiler, tok, {"type": "integer", "maximum": 2**63 - 1})
    assert walk(str(2**63 - 1)) and not walk(str(2**63))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("bound", [2**53 - 1, 2**53, -(2**53) + 1, 10**17])
def test_number_bounds_a_double_spells_are_never_passed(compiler, tok, backend, bound):
    """A bound on numbers beyond ±2^53 that a double spells is never passed, decimals
    included (MaskBench Snowplow: ``maximum: 9007199254740991`` on a number). Numbers in any
    spelling, so that the bound alone decides (the bounded form has no room for these decimals)."""
    options = {"backend": backend, "json_numbers": "any"}
    for key, holds in (("maximum", lambda x: x <= bound), ("exclusiveMinimum", lambda x: x > bound)):
        compiled = compiler.compile(ConstraintSpec("json_schema", {"type": "number", key: bound}, options))
        for delta in ("-1", "-0.5", "-0.0000001", "0", "0.0000001", "0.4", "1"):
            value = Fraction(bound) + Fraction(delta)
            text = _decimal_text(value)
            accepted = walk_text(compiled, tok, text)
            # llguidance compares exactly; xgrammar never lets a number past the bound but
            # refuses some long decimals inside it
            assert accepted == holds(value) if backend == "llguidance" else not accepted or holds(value), (key, text)
        assert walk_text(compiled, tok, str(bound + (1 if key == "exclusiveMinimum" else 0)))


def _decimal_text(value: Fraction) -> str:
    """``value`` (a decimal fraction) written as a plain JSON number."""
    sign, value = ("-", -value) if value < 0 else ("", value)
    whole, rest = divmod(value.numerator, value.denominator)
    places = 0
    while (rest * 10**places) % value.denominator:
        places += 1
    fraction = str(rest * 10**places // value.denominator).rjust(places, "0") if places else ""
    return f"{sign}{whole}" + (f".{fraction}" if fraction else "")


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "number", "exclusiveMaximum": 972783798187987123879878123.18878137}, "exclusiveMaximum"),
    ({"type": "number", "maximum": 2**60}, "maximum"),  # a double, but written back as 1152921504606847000
    ({"minimum": -18446744073709551615}, "minimum"),
    ({"type": "integer", "maximum": 18446744073709551615}, "maximum"),
    ({"properties": {"n": {"type": "number", "maximum": 2**53 + 1}}}, "maximum"),
    ({"type": "integer", "maximum": 2**53 + 1}, "maximum"),
    ({"const": 12345678901234567890}, "const"),  # llguidance matched 12345678901234567000
    ({"enum": ["a", [1, {"n": 9007199254740993}]]}, "enum"),
])
def test_numbers_no_backend_reads_exactly_are_refused(compiler, schema, keyword):
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert info.value.keyword == keyword and "2^53" in info.value.message


def test_bounded_multiples_are_exact_decimals(compiler, tok):
    """0.3 is a multiple of 0.1 (jsonschema's float division says not); the values listed are
    the decimals, not 0.30000000000000004."""
    schema = {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.1, "not": {"const": 0.5}}
    assert 0.3 in rewrite_schema(schema)["enum"]
    walk = _walker(compiler, tok, schema)
    assert walk("0.3") and walk("0.7") and walk("1")
    assert not walk("0.5") and not walk("0.30000000000000004") and not walk("0.35")


def test_xgrammar_is_not_given_untyped_string_or_number_keywords(compiler):
    """xgrammar applies ``pattern`` or ``minimum`` only beside a ``type`` (``{"pattern": "^a$"}``
    takes any value there): such a schema is not handed to it."""
    for schema in ({"pattern": "^a$"}, {"minimum": 5}, {"properties": {"a": {"maxLength": 2}}}):
        with pytest.raises(UnsupportedConstraintError, match="xgrammar"):
            compiler.compile(ConstraintSpec("json_schema", schema, {"backend": "xgrammar"}))


@pytest.mark.parametrize("step", [0.25, 0.125, 0.05])
def test_a_decimal_step_takes_every_spelling_of_its_multiples(compiler, tok, step):
    """llguidance writes a multiple of 0.25 with exactly two decimals; the steps at coarser
    scales (numbers.decimal_spellings) let ``2.5`` and ``2.0`` through, and nothing else (zeros
    past the step's own decimals, ``2.500``, are still not taken)."""
    compiled = compiler.compile(ConstraintSpec("json_schema", {"type": "number", "multipleOf": step}))
    exact_step = Fraction(str(step))
    for hundredths in range(0, 300, 5):
        value = Fraction(hundredths, 100)
        for places in range(1, len(str(step).split(".")[1]) + 1):
            text = f"{float(value):.{places}f}"
            if Fraction(text) != value:
                continue
            assert walk_text(compiled, tok, text) == ((value / exact_step).denominator == 1), text
