"""Where an ECMA-262 regex uses the constructs that are no plain regular expression syntax.

:func:`scan` walks a regex as its client wrote it (before :mod:`.dialect` translates it) and
lists each anchor (``^ $``, and ``\\A \\z \\Z`` as the Rust and Python dialects write them),
lookaround (``(?= (?! (?<= (?<!``, with the extent of its group), word boundary (``\\b \\B``)
and backreference (``\\1``, ``\\k<name>``) with its offset, so that a refusal can name the
construct and where it is. Character classes and escapes are skipped the way Python's ``re``
reads them (a ``]`` right after ``[`` or ``[^`` is a literal), since the structure itself comes
from Python's parser (see :mod:`.frontend`).

:func:`tagged` writes the regex with every assertion inside a named group ``(?P<_trellis_aN>…)``: the
parse tree then tells which construct (``N``) each assertion node is, whatever Python's parser
does to the branches around it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOOKAROUNDS = {"(?=": "lookahead", "(?!": "negative lookahead", "(?<=": "lookbehind", "(?<!": "negative lookbehind"}
ANCHORS = {"^": "start anchor", "$": "end anchor", "\\A": "start anchor", "\\z": "end anchor", "\\Z": "end anchor"}
BOUNDARIES = {"\\b": "word boundary", "\\B": "non-word boundary"}
TAG = "_trellis_a"  # prefix of the group names tagged() writes
_BACKREF = re.compile(r"\\(?:[1-9][0-9]*|k<[^>]*>?)")
_QUANTIFIER = re.compile(r"[*+?]|\{[0-9]+(?:,[0-9]*)?\}")


@dataclass(frozen=True)
class Construct:
    """One construct of the regex text: ``text`` as written (``(?=`` for a lookahead) and the
    offsets of its first character and one past its last (the whole group of a lookaround)."""

    text: str
    start: int
    end: int

    @property
    def name(self) -> str:
        """What the construct is, in words (``lookbehind``, ``word boundary``, ...)."""
        if self.text in LOOKAROUNDS:
            return LOOKAROUNDS[self.text]
        return ANCHORS.get(self.text) or BOUNDARIES.get(self.text) or "backreference"

    def describe(self) -> str:
        """``lookahead (?= at offset 3``: the words a refusal names it with."""
        return f"{self.name} {self.text} at offset {self.start}"

    @property
    def is_assertion(self) -> bool:
        return self.name != "backreference"

    @property
    def is_anchor(self) -> bool:
        return self.text in ANCHORS


@dataclass(frozen=True)
class Scan:
    """The constructs of a regex in the order they are written, and ECMA named groups
    (``(?<name>``: offsets of their ``<``), which Python's parser spells ``(?P<name>``."""

    constructs: tuple[Construct, ...]
    named_groups: tuple[int, ...]
    quantified: Construct | None  # an assertion ECMA-262 forbids a quantifier on (``^*``)

    def backreference(self) -> Construct | None:
        return next((c for c in self.constructs if c.name == "backreference"), None)


def scan(regex: str) -> Scan:
    """The anchors, lookarounds, word boundaries and backreferences of ``regex``."""
    found: list[Construct] = []
    named: list[int] = []
    open_groups: list[tuple[str, int]] = []  # (lookaround text or "", start)
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i = _escape(regex, i, found)
        elif c == "[":
            i = _class_end(regex, i)
        elif c == "(":
            i = _group_start(regex, i, open_groups, named)
        elif c == ")":
            if open_groups:
                text, start = open_groups.pop()
                if text:
                    found.append(Construct(text, start, i + 1))
            i += 1
        else:
            if c in "^$":
                found.append(Construct(c, i, i + 1))
            i += 1
    found.sort(key=lambda k: k.start)
    return Scan(tuple(found), tuple(named), _quantified(regex, found))


def _escape(regex: str, i: int, found: list[Construct]) -> int:
    """Records ``\\b \\B \\A \\z \\Z`` and backreferences; returns the offset past the escape."""
    if m := _BACKREF.match(regex, i):
        found.append(Construct(m.group(0), i, m.end()))
        return m.end()
    unit = regex[i:i + 2]
    if unit in BOUNDARIES or unit in ANCHORS:
        found.append(Construct(unit, i, i + 2))
    return i + 2


def _class_end(regex: str, i: int) -> int:
    """The offset past the character class opening at ``i`` (Python's reading)."""
    i += 1
    if regex.startswith("^", i):
        i += 1
    if regex.startswith("]", i):
        i += 1
    while i < len(regex) and regex[i] != "]":
        i += 2 if regex[i] == "\\" else 1
    return i + 1


def _group_start(regex: str, i: int, open_groups: list[tuple[str, int]], named: list[int]) -> int:
    if regex.startswith("(?#", i):  # a comment: skipped whole
        end = regex.find(")", i)
        return len(regex) if end < 0 else end + 1
    text = next((t for t in LOOKAROUNDS if regex.startswith(t, i)), "")
    if not text and regex.startswith("(?<", i):
        named.append(i + 2)
    open_groups.append((text, i))
    return i + (len(text) or 1)


def _quantified(regex: str, found: list[Construct]) -> Construct | None:
    """The first assertion other than a lookahead that a quantifier follows."""
    for c in found:
        if c.is_assertion and c.text not in ("(?=", "(?!") and _QUANTIFIER.match(regex, c.end):
            return c
    return None


def tagged(regex: str, found: Scan) -> str:
    """``regex`` for Python's parser: each assertion of ``found`` inside a group named
    ``<TAG><index>``, ECMA named groups as plain groups, ``\\z`` as Python's ``\\Z``."""
    edits: list[tuple[int, int, str]] = []  # (offset, order at that offset, text inserted)
    for index, c in enumerate(found.constructs):
        if c.is_assertion:
            edits.append((c.start, 1, f"(?P<{TAG}{index}>"))
            edits.append((c.end, 0, ")"))
    out, last = [], 0
    replaced = {at: ":" for at in found.named_groups} | {c.start + 1: "Z" for c in found.constructs if c.text == "\\z"}
    for at, _, text in sorted(edits):
        out.append(_replace(regex, last, at, replaced))
        out.append(text)
        last = at
    out.append(_replace(regex, last, len(regex), replaced))
    return "".join(out)


def _replace(regex: str, start: int, end: int, replaced: dict[int, str]) -> str:
    """``regex[start:end]`` with the characters at ``replaced``'s offsets replaced (``<name>``
    of a named group: the whole name, so that ``(?<x>`` reads ``(?:``)."""
    out, i = [], start
    while i < end:
        if i in replaced and replaced[i] == ":":
            close = regex.find(">", i)
            out.append(":")
            i = len(regex) if close < 0 else close + 1
        else:
            out.append(replaced.get(i, regex[i]))
            i += 1
    return "".join(out)
