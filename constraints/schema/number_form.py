"""The bounded form of JSON numbers for the one-line layouts ("dumps", "compact"): issue #30, item 5.

JSON's number grammar has no length limit, and a small model can spend its whole budget on one
number (``31.00000000000001E+00000000000000000000000001``). Under the one-line layouts a number
is written in this bounded form instead (the ``flexible`` layout keeps any JSON number):

``-?`` followed by either

* an integer, without point or exponent: ``0``, or at most :data:`MAX_INTEGER_DIGITS` (20)
  digits with no leading zero (``json.dumps`` of every int64 and uint64 fits: ``2**64 - 1`` has 20);
* a mantissa with a point, an exponent or both, whose digits (integer part and fraction) hold at
  most :data:`MAX_SIGNIFICANT` (17) significant digits: the digits from the first nonzero one on,
  trailing zeros included (``1.23456789012345678`` has 18). A mantissa below 1 has at most
  :data:`MAX_LEADING_ZEROS` (6) zeros between ``0.`` and its first nonzero digit, or in all when it
  has none (``0.000001``, ``0.0``). The exponent, ``[eE][+-]?`` then 1 to
  :data:`MAX_EXPONENT_DIGITS` (3) digits, may have leading zeros within those 3: ``json.dumps``
  writes ``1e-05``; ``1E+0001`` is refused.

Every text ``json.dumps`` writes for a Python int within ±(10**20 - 1) or any finite float is in
this form (``repr`` of a double has at most 17 significant digits, a 3-digit exponent, at most 3
zeros after ``0.``, and fixed notation only below 1e16). The form is a regular language:
:data:`NUMBER_REGEX` spells it (Python ``re``, ECMA-262, Lark and GBNF read it alike: no
look-around, no lazy quantifier), and :class:`NumberForm` scans whole one-line JSON texts for it
byte by byte (strings skipped), with a relaxed state for a number whose schema leaves it no
bounded spelling (a ``const`` of 10**30, an integer ``minimum`` of 10**25): the form only ever
removes texts from a language, so a caller falls back to the unbounded form where it would
leave none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_INTEGER_DIGITS = 20
MAX_SIGNIFICANT = 17
MAX_LEADING_ZEROS = 6
MAX_EXPONENT_DIGITS = 3
BOUNDED_LAYOUTS = ("dumps", "compact")  # constraints.spec.JSON_LAYOUTS that get the bounded form


def _nonzero_mantissas() -> str:
    """Mantissas >= 1: k integer digits and at most MAX_SIGNIFICANT - k fraction digits."""
    parts = []
    for k in range(1, MAX_SIGNIFICANT + 1):
        whole = "[1-9]" + (f"[0-9]{{{k - 1}}}" if k > 1 else "")
        room = MAX_SIGNIFICANT - k
        parts.append(whole + (f"(?:\\.[0-9]{{1,{room}}})?" if room else ""))
    return "|".join(parts)


INTEGER_REGEX = f"-?(?:0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}})"
_BELOW_ONE = (f"0(?:\\.(?:0{{1,{MAX_LEADING_ZEROS}}}|0{{0,{MAX_LEADING_ZEROS}}}[1-9][0-9]{{0,{MAX_SIGNIFICANT - 1}}}))?")
_EXPONENT = f"[eE][+-]?[0-9]{{1,{MAX_EXPONENT_DIGITS}}}"
NUMBER_REGEX = f"-?(?:0|[1-9][0-9]{{0,{MAX_INTEGER_DIGITS - 1}}}|(?:{_BELOW_ONE}|{_nonzero_mantissas()})(?:{_EXPONENT})?)"
_NUMBER = re.compile(NUMBER_REGEX)
_INTEGER = re.compile(INTEGER_REGEX)


def is_bounded_number(text: str) -> bool:
    """Whether ``text`` is a JSON number in the bounded form."""
    return _NUMBER.fullmatch(text) is not None


def is_bounded_integer(text: str) -> bool:
    """Whether ``text`` is a JSON integer (no point, no exponent) in the bounded form."""
    return _INTEGER.fullmatch(text) is not None


def bounded_layout(layout: str) -> bool:
    """Whether numbers written in ``layout`` (``ConstraintSpec.json_layout``) take the bounded form."""
    return layout in BOUNDED_LAYOUTS


# -- a byte scanner of one-line JSON text --------------------------------------------------------

@dataclass(frozen=True)
class _Num:
    """Inside a number: ``part`` is what was read last (``-``: the sign; ``zero``: an integer part
    ``0``; ``int``: a nonzero integer part; ``.``: the point; ``frac``: fraction digits; ``e``:
    the exponent letter; ``esign``: its sign; ``exp``: exponent digits)."""

    part: str
    digits: int = 0  # integer-part digits (part "int"), exponent digits (part "exp")
    significant: int = 0  # mantissa digits from the first nonzero one on
    zeros: int = 0  # zeros between "0." and the first nonzero digit


OUT, STRING, ESCAPE, FREE = "out", "string", "escape", "free"
_COMPLETE = frozenset({"zero", "int", "frac", "exp"})
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")


class NumberForm:
    """Scans one-line JSON text (``json.dumps`` / compact layout) a byte at a time and refuses a
    byte that takes a number out of the bounded form. It checks no other JSON syntax (the grammar
    beside it does); a string (``"`` to the unescaped ``"``) is skipped whole.

    States are hashable: :data:`OUT` (between tokens), :data:`STRING`, :data:`ESCAPE` (after a
    backslash in a string), a number in progress, and :data:`FREE`, a number :meth:`relax` ed
    out of the bound (any number bytes, until the first other byte)."""

    start = OUT

    @staticmethod
    def step(state, byte: int):
        """The state after ``byte``, or None when the byte leaves the bounded form."""
        if state == STRING:
            return OUT if byte == 0x22 else ESCAPE if byte == 0x5C else STRING
        if state == ESCAPE:
            return STRING
        if state == FREE:
            return FREE if byte in _NUMBER_BYTES else NumberForm.step(OUT, byte)
        if state == OUT:
            if byte == 0x22:
                return STRING
            if byte == 0x2D:
                return _Num("-")
            if 0x30 <= byte <= 0x39:
                return _digit(_Num("-"), byte)
            return OUT
        if byte in _NUMBER_BYTES:
            return _number_step(state, byte)
        if state.part not in _COMPLETE:
            return None
        return NumberForm.step(OUT, byte)  # the number ends at this byte

    @staticmethod
    def relax(state):
        """``state`` with a number in progress released from the bound (it goes on as any JSON
        number): for a caller whose grammar allows no bounded continuation."""
        return FREE if isinstance(state, _Num) else state

    @staticmethod
    def can_end(state) -> bool:
        """Whether the text may end in ``state`` (between tokens, or after a complete number)."""
        return state in (OUT, FREE) or isinstance(state, _Num) and state.part in _COMPLETE

    @classmethod
    def scan(cls, data: bytes, state=OUT):
        """The state after ``data`` (None: it leaves the bounded form)."""
        for byte in data:
            state = cls.step(state, byte)
            if state is None:
                return None
        return state

    @classmethod
    def accepts(cls, text: str) -> bool:
        """Whether every number of the one-line JSON ``text`` is in the bounded form."""
        state = cls.scan(text.encode("utf-8"))
        return state is not None and cls.can_end(state)


def _digit(num: _Num, byte: int):
    nonzero = byte != 0x30
    part = num.part
    if part == "-":
        return _Num("int", 1, 1) if nonzero else _Num("zero")
    if part == "zero":
        return None  # a leading zero
    if part == "int":
        if num.digits >= MAX_INTEGER_DIGITS:
            return None
        return _Num("int", num.digits + 1, num.significant + 1)
    if part in (".", "frac"):
        if num.significant:
            significant = num.significant + 1
            return _Num("frac", 0, significant) if significant <= MAX_SIGNIFICANT else None
        if nonzero:
            return _Num("frac", 0, 1, num.zeros)
        return _Num("frac", 0, 0, num.zeros + 1) if num.zeros < MAX_LEADING_ZEROS else None
    # "e", "esign", "exp"
    digits = num.digits + 1 if part == "exp" else 1
    return _Num("exp", digits) if digits <= MAX_EXPONENT_DIGITS else None


def _number_step(num: _Num, byte: int):
    if 0x30 <= byte <= 0x39:
        return _digit(num, byte)
    part = num.part
    if byte == 0x2E:  # a point: after the integer part, with room left for a fraction digit
        room = part == "zero" or part == "int" and num.significant < MAX_SIGNIFICANT
        return _Num(".", 0, num.significant) if room else None
    if byte in b"eE":  # an exponent: after a mantissa of at most 17 significant digits
        done = part in ("zero", "frac") or part == "int" and num.significant <= MAX_SIGNIFICANT
        return _Num("e") if done else None
    return _Num("esign") if part == "e" else None  # + or -
