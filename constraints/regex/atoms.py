"""The characters of a regex as *atoms*: maximal sets of code points that every character set
of the regex treats alike.

An automaton over atoms has one transition per atom, however many code points the atom
holds: ``[^a]`` costs one symbol, not a million. :func:`char_sets` lists the sets a parsed regex
uses (ECMA-262 meanings: ``.`` leaves out the line terminators unless ``(?s)`` is in force),
:class:`Atoms` cuts the code points by them and writes a set of atoms back as a class.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import Any

from .dialect import DIGIT, LINE_TERMINATORS, SPACE, WORD, Ranges, class_items, complement

try:  # Python 3.11+
    from re import _constants as _c
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]

MAX_CHAR = 0x10FFFF
CHARS = (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN)  # the parse-tree items that are one character
_CATEGORIES = {
    _c.CATEGORY_DIGIT: DIGIT, _c.CATEGORY_NOT_DIGIT: complement(DIGIT),
    _c.CATEGORY_WORD: WORD, _c.CATEGORY_NOT_WORD: complement(WORD),
    _c.CATEGORY_SPACE: SPACE, _c.CATEGORY_NOT_SPACE: complement(SPACE),
}


class Atoms:
    """The atoms that ``sets`` cut the code points into: atom ``i`` is ``ranges[i]``."""

    def __init__(self, sets: list[Ranges]) -> None:
        cuts = sorted({0, MAX_CHAR + 1} | {lo for s in sets for lo, _ in s} | {hi + 1 for s in sets for _, hi in s})
        starts = [[lo for lo, _ in s] for s in sets]
        groups: dict[tuple[bool, ...], Ranges] = {}
        for lo, nxt in itertools.pairwise(cuts):
            signature = tuple(_contains(s, firsts, lo) for s, firsts in zip(sets, starts))
            groups.setdefault(signature, []).append((lo, nxt - 1))
        self.ranges = list(groups.values())
        self._firsts = [atom[0][0] for atom in self.ranges]
        self._of: dict[tuple, list[int]] = {}

    def __len__(self) -> int:
        return len(self.ranges)

    def of(self, ranges: Ranges) -> list[int]:
        """The atoms making up ``ranges``; KeyError when ``ranges`` cuts an atom (it is no
        union of the sets the atoms were cut by)."""
        key = tuple(ranges)
        if key not in self._of:
            starts = [lo for lo, _ in ranges]
            inside = [i for i, first in enumerate(self._firsts) if _contains(ranges, starts, first)]
            if size(ranges) != sum(size(self.ranges[i]) for i in inside):
                raise KeyError(key)
            self._of[key] = inside
        return self._of[key]

    def label(self, atoms: list[int]) -> str:
        """A class matching the characters of ``atoms``: a single character as itself, a class
        listing them, or a negated one when what it leaves out is smaller (interegular, which
        later analyses use, reads a negated class cheaply)."""
        ranges = merged([r for i in atoms for r in self.ranges[i]])
        missing = complement(ranges)
        if not missing:
            return self.every_char()
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return class_items(ranges)  # escaped where it is not alphanumeric
        if size(ranges) <= size(missing):
            return f"[{class_items(ranges)}]"
        return f"[^{class_items(missing)}]"

    def every_char(self) -> str:
        """Any one character, as a union of two classes cut along atoms (not ``[\\s\\S]``,
        which interegular would spell out character by character)."""
        some = class_items(min(self.ranges, key=len))
        return f"(?:[{some}]|[^{some}])"


def char_sets(items: list, dotall: bool) -> list[Ranges]:
    """Every character set the parse-tree ``items`` use (lookaround bodies included), with the
    dot-all flag in force where each stands."""
    out: list[Ranges] = []
    for op, av in items:
        if op in CHARS:
            out.append(char_set(op, av, dotall))
        elif op is _c.BRANCH:
            for branch in av[1]:
                out += char_sets(branch, dotall)
        elif op is _c.SUBPATTERN:
            _, add, remove, sub = av
            out += char_sets(sub, dotall_in(dotall, add, remove))
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            out += char_sets(av[2], dotall)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            out += char_sets(av[1], dotall)  # (direction, items)
    return out


def dotall_in(dotall: bool, add: int, remove: int) -> bool:
    """Whether ``(?s)`` is in force inside a group that adds / removes these flags."""
    return bool((dotall or add & re.DOTALL) and not remove & re.DOTALL)


def char_set(op: Any, av: Any, dotall: bool) -> Ranges:
    """The code points one character item of a parse tree matches, ECMA-262's way; ValueError
    for a class item with no ECMA meaning here (a locale category, say)."""
    if op is _c.LITERAL:
        return [(av, av)]
    if op is _c.NOT_LITERAL:
        return complement([(av, av)])
    if op is _c.ANY:
        return [(0, MAX_CHAR)] if dotall else complement(LINE_TERMINATORS)
    negate = bool(av) and av[0][0] is _c.NEGATE
    ranges: Ranges = []
    for kind, value in av[1:] if negate else av:
        if kind is _c.LITERAL:
            ranges.append((value, value))
        elif kind is _c.RANGE:
            ranges.append(value)
        elif kind is _c.CATEGORY and value in _CATEGORIES:
            ranges.extend(_CATEGORIES[value])
        else:
            raise ValueError(f"the class item {str(kind).lower()} is not supported here")
    return complement(merged(ranges)) if negate else merged(ranges)


def merged(ranges: list[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, overlapping and adjacent ones joined."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def size(ranges: Ranges) -> int:
    """How many code points ``ranges`` holds."""
    return sum(hi - lo + 1 for lo, hi in ranges)


def _contains(ranges: Ranges, firsts: list[int], cp: int) -> bool:
    at = bisect.bisect_right(firsts, cp) - 1
    return at >= 0 and ranges[at][1] >= cp
