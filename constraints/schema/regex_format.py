"""``format: "regex"`` as a regular language of regexes: exact from inside.

ECMA-262 patterns nest groups to any depth, which no regular language describes, so the format
is enforced as a *narrowing*: every string this pattern accepts is a regular expression that
ECMA-262 compiles (``new RegExp(s)``, with or without the ``u`` flag) and that Python's ``re``
compiles too (jsonschema's format checker), and the common shapes are all there:

* literals: printable ASCII (U+0020-U+007E) except the syntax characters
  ``^ $ \\ . * + ? ( ) [ ] { } |``; ``.``; the escapes ``\\d \\D \\w \\W \\s \\S \\n \\r \\t \\f
  \\v`` and a backslash before a syntax character or ``/``;
* assertions ``^``, ``$``, ``\\b``, ``\\B`` (never quantified);
* classes ``[...]`` / ``[^...]``, not empty, of literals (printable ASCII but ``\\ ] [ ^ - & ~
  |``, which either engine reads as syntax or warns about doubled), the escapes above (and
  ``\\-``), a hyphen first, last or after a range, and ranges between letters and digits
  written in order (``a-f``, ``A-z``, not ``f-a``);
* quantifiers ``* + ?``, ``{m}``, ``{m,}`` (``m`` up to 999) and ``{m,n}`` with ``m <= n``,
  ``m`` of at most two digits and ``n`` of at most three, each optionally lazy (``?``);
* alternation ``|`` anywhere (empty alternatives included), groups ``(...)`` and ``(?:...)``
  nested at most :data:`MAX_GROUP_DEPTH` deep, and lookaheads ``(?=...)`` / ``(?!...)`` at the
  top level (holding groups one level less deep).

Left out (never generated): deeper nesting, lookbehinds, named groups, back-references, octal,
``\\c``, ``\\x`` / ``\\u`` escapes, other ranges, and non-ASCII literals.
"""

from __future__ import annotations

from functools import lru_cache

from ..regex.dialect import class_items, point_ranges

MAX_GROUP_DEPTH = 4  # groups inside groups, four deep
_PRINTABLE = (0x20, 0x7E)
_SYNTAX = "^$\\.*+?()[]{}|"
_SHORTHANDS = "dDwWsSnrtfv"


def _class_of(chars: str) -> str:
    """A class of exactly ``chars``."""
    return f"[{class_items(point_ranges(sorted(set(map(ord, chars)))))}]"


def _printable_except(excluded: str) -> str:
    """A class of the printable ASCII characters not in ``excluded``."""
    return _class_of("".join(chr(cp) for cp in range(_PRINTABLE[0], _PRINTABLE[1] + 1) if chr(cp) not in excluded))


def _escape(extra: str = "") -> str:
    """A backslash and a shorthand class, a syntax character, ``/`` or one of ``extra``."""
    return "\\\\" + _class_of(_SHORTHANDS + _SYNTAX + "/" + extra)


def _ordered_ranges() -> str:
    """``x-y`` for every letter or digit ``x`` and ``y`` with ``x <= y`` (``a-z``, ``A-z``)."""
    alnum = sorted("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return "(?:" + "|".join(f"{c}-{_class_of(''.join(alnum[i:]))}" for i, c in enumerate(alnum)) + ")"


def character_class() -> str:
    """The regex of the classes in the language (``[a-z_-]``, ``[^'"]``, ``[\\d.]``): a bare
    hyphen is a range's, or first, last or right after a range (``[a-z-_]``), never two in a
    row: both engines read it as itself there."""
    single = f"(?:{_printable_except(chr(92) + '][^-&~|')}|{_escape('-')})"
    ranged = _ordered_ranges()
    return f"\\[\\^?(?:-|-?(?:{single}|{ranged}-?)*(?:{single}|{ranged})-?)\\]"


def _from(first: str) -> str:
    """The digits from ``first`` to 9, as a class."""
    return f"[{first}-9]"


def bounds_in_order() -> str:
    """``m,n`` with ``m <= n``: ``m`` of one or two digits, ``n`` of one to three, no leading
    zeros (a pair of three-digit numbers is left out: it would spell out a thousand cases)."""
    one, two, three = "[0-9]", "[1-9][0-9]", "[1-9][0-9]{2}"
    shorter = [f"{one},(?:{two}|{three})", f"{two},{three}"]
    same_one = [f"{d},{_from(d)}" for d in "0123456789"]
    same_two = []
    for a in "123456789":
        alts = [f"{b},{a}{_from(b)}" for b in "0123456789"]
        if a != "9":
            alts.append(f"[0-9],{_from(str(int(a) + 1))}[0-9]")
        same_two.append(f"{a}(?:{'|'.join(alts)})")
    return "(?:" + "|".join(shorter + same_one + same_two) + ")"


def quantifier() -> str:
    """``* + ?`` and the braced counts, each optionally lazy."""
    count = "(?:0|[1-9][0-9]{0,2})"
    return f"(?:(?:[*+?]|\\{{(?:{count},?|{bounds_in_order()})\\}})\\??)"


def _terms(depth: int, lookaheads: bool) -> str:
    """Alternatives and terms, with groups nested at most ``depth`` deep (lookaheads too when
    ``lookaheads``: they are not quantified, and hold no lookahead)."""
    literal = _printable_except(_SYNTAX)
    atoms = [literal, "\\.", _escape(), character_class()]
    if depth > 0:
        atoms.append(f"\\((?:\\?:)?{_terms(depth - 1, False)}\\)")
    assertions = ["\\^", "\\$", "\\\\[bB]", "\\|"]
    if lookaheads and depth > 0:
        assertions.append(f"\\(\\?[=!]{_terms(depth - 1, False)}\\)")
    return f"(?:(?:{'|'.join(atoms)}){quantifier()}?|{'|'.join(assertions)})*"


@lru_cache(maxsize=1)
def regex_format_pattern() -> str:
    """The whole-string regex of the ``regex`` format's strings (the language above)."""
    return f"^{_terms(MAX_GROUP_DEPTH, True)}$"
