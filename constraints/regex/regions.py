"""Overlapping patterns cut into disjoint regions: for patterns ``P1 .. Pn``, the sets of
strings matched by exactly the patterns of some group (``P1`` and ``P2`` but not ``P3``, ...),
each written as a pattern.

llguidance refuses an object whose ``patternProperties`` regexes overlap (a key matching two of
them must meet both subschemas, which it does not build). The regions of those regexes are
disjoint, and a key matching one of them meets exactly the subschemas of its group.

Every region is built as a DFA (the patterns' languages, :mod:`.disjoint`, intersected and
subtracted), written back by state elimination and checked against its DFA
(:func:`.complement.written_pattern`); where a pattern has no DFA here, or a region is too
large to write, there are no regions (None).
"""

from __future__ import annotations

from typing import Any

from .complement import trimmed, written_pattern
from .disjoint import pattern_language

MAX_REGIONS = 16  # non-empty regions written out, at most


def pattern_regions(patterns: list[str]) -> list[tuple[str, tuple[int, ...]]] | None:
    """(pattern of the region, indices of the patterns its strings match), one per non-empty
    region matched by some pattern; None when they cannot all be written."""
    languages = [pattern_language(p) for p in patterns]
    if any(language is None for language in languages):
        return None
    try:
        regions = _refine(languages)
    except Exception:  # interegular gave up somewhere: nothing is promised
        return None
    if regions is None:
        return None
    out = []
    for fsm, members in regions:
        written = written_pattern(fsm)
        if written is None:
            return None
        out.append((written, members))
    return out


def _refine(languages: list[Any]) -> list[tuple[Any, tuple[int, ...]]] | None:
    """The non-empty regions (trimmed DFAs) of ``languages``, each with the indices of the
    languages that hold its strings; None past :data:`MAX_REGIONS`."""
    regions: list[tuple[Any, tuple[int, ...]]] = []
    for i, language in enumerate(languages):
        rest = language
        refined = []
        for fsm, members in regions:
            refined += _nonempty([(fsm & language, (*members, i)), (fsm - language, members)])
            rest = rest - fsm
        regions = refined + _nonempty([(rest, (i,))])
        if len(regions) > MAX_REGIONS:
            return None
    return regions


def _nonempty(candidates: list[tuple[Any, tuple[int, ...]]]) -> list[tuple[Any, tuple[int, ...]]]:
    out = []
    for fsm, members in candidates:
        kept = trimmed(fsm.reduce())
        if kept is not None:
            out.append((kept, members))
    return out


def intersect_patterns(a: str, b: str) -> str | bool | None:
    """The strings matching both patterns: True when every string ``a`` matches also matches
    ``b`` (``a`` as written will do), ``b`` when every string ``b`` matches also matches ``a``,
    False when none does, else their pattern; None when that cannot be told or written here."""
    fa, fb = pattern_language(a), pattern_language(b)
    if fa is None or fb is None:
        return None
    try:
        if (fa - fb).empty():
            return True
        if (fb - fa).empty():
            return b
        both = trimmed((fa & fb).reduce())
    except Exception:  # interegular gave up somewhere: nothing is promised
        return None
    return False if both is None else written_pattern(both)


def pattern_matches(pattern: str, text: str) -> bool | None:
    """Whether ``text`` holds a match of ``pattern`` (ECMA-262 search), read on its DFA; None
    when the pattern has none here."""
    fsm = pattern_language(pattern)
    if fsm is None:
        return None
    try:
        return bool(fsm.accepts(text))
    except Exception:
        return None


def subtract_patterns(pattern: str, others: list[str]) -> str | bool | None:
    """The strings ``pattern`` matches and none of ``others`` does: True when that is all of
    ``pattern``'s (``pattern`` as written will do), False when none, else their pattern; None
    when that cannot be told or written here."""
    fa = pattern_language(pattern)
    languages = [pattern_language(o) for o in others]
    if fa is None or any(language is None for language in languages):
        return None
    try:
        rest = fa
        for language in languages:
            rest = rest - language
        if (fa - rest).empty():
            return True
        left = trimmed(rest.reduce())
    except Exception:  # interegular gave up somewhere: nothing is promised
        return None
    return False if left is None else written_pattern(left)
