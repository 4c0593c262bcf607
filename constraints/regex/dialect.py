"""One regex dialect for every backend: ECMA-262 classes, as JSON Schema's ``pattern`` means them.

The backends disagree on shorthand classes: outlines-core and llguidance (Rust ``regex-syntax``)
read ``\\d`` as every Unicode decimal digit (``🯸`` included), xgrammar reads it as ``[0-9]``.
ECMA-262 -- the dialect of JSON Schema's ``pattern`` and what OpenAI-style clients write --
means ASCII. So before any backend sees a regex, :func:`ecma_regex` rewrites the shorthands into
explicit classes:

* ``\\d`` = ``[0-9]``, ``\\w`` = ``[A-Za-z0-9_]``, ``\\s`` = ECMA's white space and line
  terminators (tab, LF, VT, FF, CR, space, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
  U+202F, U+205F, U+3000, U+FEFF); ``\\D \\W \\S`` their complements, inside classes too
  (``[\\D.]``, ``[^\\W]``);
* ``.`` = any character but a line terminator (LF, CR, U+2028, U+2029), unless an inline
  ``s`` flag (``(?s)``) asks for "any character";
* ``[\\b]`` = backspace (ECMA), which the Rust dialect would reject.

For a ``pattern`` inside a JSON schema (``json_string=True``) one more rewrite works around an
llguidance defect (1.9.1): where a position allows every control character U+0000-U+001F, its
JSON-string quoting also admits the escapes ``\\"`` and ``\\\\`` even when the class excludes
``"`` or ``\\``, so ``[^"]`` let ``\\"`` through. Such negated classes also exclude U+0000 (a
NUL is then never generated there; every other string is unchanged), which keeps the position
short of the full control range and the quoting exact.

Unicode stays available where it is asked for explicitly: ``\\p{…}`` / ``\\P{…}`` pass
through unchanged. Everything else is copied verbatim (escaped backslashes, quantifier braces,
groups, ``\\u`` escapes), so a pattern without shorthands is returned as given. Emitted code
points are written as ``\\uXXXX`` / ``\\UXXXXXXXX``, which all three backends and Python's ``re``
(used for the emptiness analysis) read alike.
"""

from __future__ import annotations

import re

_MAX = 0x10FFFF
Ranges = list[tuple[int, int]]

DIGIT: Ranges = [(0x30, 0x39)]
WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE: Ranges = [
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
]
LINE_TERMINATORS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]


def _char(cp: int) -> str:
    if cp < 0x7F and (chr(cp).isalnum() or chr(cp) == "_"):
        return chr(cp)
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def point_ranges(points: list[int]) -> Ranges:
    """The sorted code points ``points`` as ranges of consecutive ones."""
    out: Ranges = []
    for cp in points:
        if out and out[-1][1] == cp - 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return out


def class_items(ranges: Ranges) -> str:
    """The body of a character class (no brackets) holding exactly ``ranges``."""
    return "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)


def complement(ranges: Ranges) -> Ranges:
    """The code points 0..U+10FFFF not in the (sorted, disjoint) ``ranges``."""
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX:
        out.append((start, _MAX))
    return out


_SETS = {"d": DIGIT, "w": WORD, "s": SPACE}
# class items of each shorthand, for use inside a class ([\d.]) ...
IN_CLASS = {k: class_items(v) for k, v in _SETS.items()} | {
    k.upper(): class_items(complement(v)) for k, v in _SETS.items()
}
# ... and whole classes, for use outside one (\D -> [^0-9], not a range list)
OUTSIDE = {k: f"[{class_items(v)}]" for k, v in _SETS.items()} | {
    k.upper(): f"[^{class_items(v)}]" for k, v in _SETS.items()
}
DOT = f"[^{class_items(LINE_TERMINATORS)}]"
_DOTALL_FLAG = re.compile(r"\(\?[a-zA-Z]*s[a-zA-Z]*[-:)]")


def ecma_regex(regex: str, dotall: bool = False, json_string: bool = False, nested_classes: bool = False) -> str:
    """``regex`` with ECMA-262 meanings made explicit (see the module docstring).

    ``dotall`` makes ``.`` match every character (Lark's ``/…/s``); an inline ``(?s`` flag
    anywhere in the pattern does the same. ``json_string`` marks a pattern that a JSON string's
    content must match (``pattern``, ``patternProperties``): negated classes are kept exact
    under llguidance's quoting. Malformed input is translated as far as it goes and left for
    the backend to reject.

    Inside a class, ``[`` and the doubled ``&&`` / ``~~`` are literal characters, as ECMA-262
    (and Python's ``re``) read them, where Rust's syntax would open a nested class or a set
    operation: ``[[a-z]*]`` is ``[``, ``a``-``z`` or ``*``. ``nested_classes`` keeps the Rust
    meaning (Lark grammars, written for llguidance's Rust regexes).
    """
    keep_dot = dotall or _DOTALL_FLAG.search(regex) is not None
    return _Translator(regex, keep_dot, json_string, nested_classes).run()


_CONTROLS = [chr(c) for c in range(0x20)]


def _quoting_breaks(negated_class: str) -> bool:
    """Whether llguidance's JSON quoting of ``negated_class`` (a ``[^…]`` as translated) would
    admit an escaped ``"`` or ``\\`` that the class excludes: it allows every control character
    but not both of those. A class Python's ``re`` cannot read is left alone."""
    try:
        cls = re.compile(negated_class)
    except (re.error, OverflowError):
        return False
    return all(cls.fullmatch(c) for c in _CONTROLS) and not (cls.fullmatch('"') and cls.fullmatch("\\"))


class _Translator:
    def __init__(self, text: str, keep_dot: bool, json_string: bool = False, nested_classes: bool = False) -> None:
        self.text = text
        self.keep_dot = keep_dot
        self.json_string = json_string
        self.nested_classes = nested_classes
        self.i = 0
        self.out: list[str] = []

    def run(self) -> str:
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c == "\\":
                self._escape(in_class=False)
            elif c == "[":
                self._class()
            elif c == "." and not self.keep_dot:
                self.out.append(DOT)
                self.i += 1
            elif text.startswith("(?#", self.i):  # comment group: copied, never translated
                end = text.find(")", self.i)
                end = len(text) if end < 0 else end + 1
                self.out.append(text[self.i:end])
                self.i = end
            else:
                self.out.append(c)
                self.i += 1
        return "".join(self.out)

    def _escape(self, in_class: bool) -> None:
        unit = self._escape_unit()
        letter = unit[1:2]
        if letter in IN_CLASS and len(unit) == 2:
            self.out.append(IN_CLASS[letter] if in_class else OUTSIDE[letter])
        elif in_class and unit == "\\b":
            self.out.append("\\u0008")  # backspace in ECMA; an error in the Rust dialect
        else:
            self.out.append(unit)

    def _escape_unit(self) -> str:
        """The escape starting at ``self.i`` (a backslash), consumed whole."""
        text, start = self.text, self.i
        letter = text[start + 1:start + 2]
        end = start + 2
        if letter in ("p", "P", "u", "x", "U") and text[end:end + 1] == "{":
            close = text.find("}", end)
            end = len(text) if close < 0 else close + 1
        elif letter in ("p", "P"):
            end += 1
        elif letter in ("u", "x", "U"):
            width = {"u": 4, "x": 2, "U": 8}[letter]
            while end < len(text) and end - start - 2 < width and text[end] in "0123456789abcdefABCDEF":
                end += 1
        elif letter == "c":
            end += 1
        self.i = end
        return text[start:end]

    def _class(self, nested: bool = False) -> None:
        """A bracketed class (nested classes, Rust style, are translated recursively)."""
        text = self.text
        start = len(self.out)
        self.out.append("[")
        self.i += 1
        if text.startswith("^", self.i):
            self.out.append("^")
            self.i += 1
        if text.startswith("]", self.i):  # a leading ] is a literal (Python / Rust)
            self.out.append("]")
            self.i += 1
        while self.i < len(text):
            c = text[self.i]
            if c == "]":
                self.i += 1
                if self.json_string and not nested and self._is_simple_negation(start):
                    if _quoting_breaks("".join(self.out[start:]) + "]"):
                        # before a trailing literal "-", which would otherwise start a range
                        at = len(self.out) - (self.out[-1] == "-" and len(self.out) - start > 2)
                        self.out.insert(at, "\\u0000")
                self.out.append("]")
                return
            if c == "\\":
                self._escape(in_class=True)
            elif not self.nested_classes and (c == "[" or (c in "&~" and text.startswith(c, self.i + 1))):
                self.out.append("\\" + c)  # a literal, as ECMA-262 reads it
                self.i += 1
            elif text.startswith("[:", self.i):  # POSIX class, copied whole
                close = text.find(":]", self.i + 2)
                end = len(text) if close < 0 else close + 2
                self.out.append(text[self.i:end])
                self.i = end
            elif c == "[":
                self._class(nested=True)
            else:
                self.out.append(c)
                self.i += 1

    def _is_simple_negation(self, start: int) -> bool:
        """Whether the class written from ``self.out[start]`` is ``[^…`` with no nested class,
        POSIX class or ``\\p`` property (whose sets ``re`` does not read the same way)."""
        body = "".join(self.out[start:])
        inner = body[2:].replace("\\\\", "").replace("\\[", "").replace("\\&", "").replace("\\~", "")
        return body.startswith("[^") and not any(
            mark in inner for mark in ("[", "\\p", "\\P", "&&", "--", "~~"))


# -- Lark grammars: translate the /regex/ terminals ---------------------------------------------

_LARK_PIECE = re.compile(
    r"""(?P<comment>//[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*")
    | /(?P<regex>(?:[^/\\\n]|\\.)+)/(?P<flags>[imslux]*)""",
    re.X,
)


def lark_regexes(grammar: str) -> list[tuple[int, str]]:
    """(offset, regex) of every ``/regex/`` terminal of a Lark grammar (strings and comments
    skipped)."""
    return [(m.start(), m.group("regex")) for m in _LARK_PIECE.finditer(grammar) if m.group("regex") is not None]


def ecma_lark(grammar: str) -> str:
    """A Lark grammar with every ``/regex/`` terminal translated by :func:`ecma_regex`
    (strings, comments and embedded JSON are left alone)."""

    def repl(m: re.Match[str]) -> str:
        if m.group("regex") is None:
            return m.group(0)
        flags = m.group("flags")
        return "/" + ecma_regex(m.group("regex"), dotall="s" in flags, nested_classes=True) + "/" + flags

    return _LARK_PIECE.sub(repl, grammar)
