"""Regex facts checked before any backend sees a regex: can it match anything at all, and
does it use anchors inside (which some backends silently ignore).

The regex is parsed with Python's own regex parser; syntax it does not know (``\\p{L}``,
``(?<name>...)``) leaves the question to the backends. Emptiness comes from the two things
that can empty a regex without intersection: a character class matching no character
(``[^\\s\\S]``) and anchors that cannot hold (``a^b``, ``a$b``). Each sub-pattern is summarised
by the *profiles* of its matches: (consumes text, asserts the start before consuming, asserts
the end after consuming); a regex is empty when it has no profile.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Iterable

from ..errors import EmptyLanguageError

try:  # Python 3.11+
    from re import _constants as _c, _parser as _p
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

Profile = tuple[bool, bool, bool]  # (consumes, needs start, needs end)
_EMPTY: Profile = (False, False, False)
_CONSUMES: Profile = (True, False, False)
_ANYTHING = frozenset({_EMPTY, _CONSUMES})  # what an unknown construct may do
_STARTS = {_c.AT_BEGINNING, _c.AT_BEGINNING_STRING}
_ENDS = {_c.AT_END, _c.AT_END_STRING}
_MAX_CHAR = 0x10FFFF
_COMPLEMENTS = [
    {_c.CATEGORY_SPACE, _c.CATEGORY_NOT_SPACE},
    {_c.CATEGORY_DIGIT, _c.CATEGORY_NOT_DIGIT},
    {_c.CATEGORY_WORD, _c.CATEGORY_NOT_WORD},
]


def parse(regex: str) -> Any | None:
    """Python's parse tree of ``regex``, or None when the syntax is not Python's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "possible nested set" and the like
            return _p.parse(regex)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None


def check_regex_nonempty(regex: str) -> None:
    """EmptyLanguageError when ``regex`` can match no string (as far as can be told)."""
    tree = parse(regex)
    if tree is not None and not _sequence(tree):
        raise EmptyLanguageError("the regex matches no string")


def has_anchors(regex: str) -> bool:
    """True when ``regex`` (after its leading ^ / trailing $ were stripped) still has ^, $, \\A
    or \\z anywhere, or cannot be parsed (then nothing is promised)."""
    tree = parse(regex)
    return tree is None or any(op is _c.AT and av in _STARTS | _ENDS for op, av in _walk(tree))


def _walk(items: Iterable) -> Iterable[tuple[Any, Any]]:
    for op, av in items:
        yield op, av
        for sub in _children(op, av):
            yield from _walk(sub)


def _children(op: Any, av: Any) -> list:
    if op is _c.SUBPATTERN:
        return [av[3]]
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        return [av[2]]
    if op is _c.BRANCH:
        return list(av[1])
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return [av]
    if op is _c.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return [av[1]]
    return []


def _sequence(items: Iterable) -> frozenset[Profile]:
    out = frozenset({_EMPTY})
    for op, av in items:
        out = _concat(out, _item(op, av))
        if not out:
            break
    return out


def _concat(left: frozenset[Profile], right: frozenset[Profile]) -> frozenset[Profile]:
    out = set()
    for a in left:
        for b in right:
            if (b[1] and a[0]) or (a[2] and b[0]):
                continue  # a start anchor after text, or text after an end anchor
            out.add((a[0] or b[0], a[1] or b[1], a[2] or b[2]))
    return frozenset(out)


def _item(op: Any, av: Any) -> frozenset[Profile]:
    if op in (_c.LITERAL, _c.NOT_LITERAL, _c.ANY):
        return frozenset({_CONSUMES})
    if op is _c.IN:
        return frozenset() if _empty_class(av) else frozenset({_CONSUMES})
    if op is _c.AT:
        if av in _STARTS:
            return frozenset({(False, True, False)})
        if av in _ENDS:
            return frozenset({(False, False, True)})
        return frozenset({_EMPTY})
    if op is _c.BRANCH:
        return frozenset().union(*(_sequence(branch) for branch in av[1]))
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        lo, hi, sub = av
        return _repeat(_sequence(sub), lo, hi)
    if op is _c.SUBPATTERN:
        return _sequence(av[3])
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return _sequence(av)
    if op is _c.GROUPREF_EXISTS:
        no = _sequence(av[2]) if av[2] is not None else frozenset({_EMPTY})
        return _sequence(av[1]) | no
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return frozenset({_EMPTY})
    return _ANYTHING


def _repeat(unit: frozenset[Profile], lo: int, hi: int) -> frozenset[Profile]:
    """Profiles of ``unit`` repeated lo..hi times (hi = MAXREPEAT: unbounded)."""
    powers = [frozenset({_EMPTY})]  # powers[k]: exactly k repetitions
    seen = {powers[0]: 0}
    while len(powers) <= hi:
        nxt = _concat(powers[-1], unit)
        if nxt in seen:  # periodic from here on
            start, period = seen[nxt], len(powers) - seen[nxt]
            break
        seen[nxt] = len(powers)
        powers.append(nxt)
    else:
        return frozenset().union(*powers[lo:])

    def power(k: int) -> frozenset[Profile]:
        return powers[k] if k < len(powers) else powers[start + (k - start) % period]

    last = min(hi, lo + len(powers) + period)  # past this, nothing new appears
    return frozenset().union(*(power(k) for k in range(lo, last + 1)))


def _empty_class(items: list) -> bool:
    """True when a character class matches no character."""
    if not items:
        return True
    if items[0][0] is not _c.NEGATE:
        return False
    categories = {av for op, av in items if op is _c.CATEGORY}
    if any(pair <= categories for pair in _COMPLEMENTS):
        return True
    spans = sorted(
        (av, av) if op is _c.LITERAL else av for op, av in items[1:] if op in (_c.LITERAL, _c.RANGE)
    )
    reach = -1
    for lo, hi in spans:
        if lo > reach + 1:
            return False
        reach = max(reach, hi)
    return reach >= _MAX_CHAR


MAX_FINITE_STRINGS = 64  # largest language finite_strings spells out


def finite_strings(pattern: str, limit: int = MAX_FINITE_STRINGS) -> list[str] | None:
    """Every string a JSON-Schema ``pattern`` matches, when the pattern is anchored at both
    ends (``^…$``) and its language has at most ``limit`` strings; else None.

    Only plain constructs are spelled out (literals, small classes of literals and ranges,
    alternation, groups, bounded repeats); anything else (negated classes, ``\\w``, lookaround,
    unbounded repeats) gives None, so a None never hides a mistake. ECMA-262's ``$`` (no
    multiline flag) matches only at the very end, so ``^X$`` means exactly the strings of X.
    """
    tree = parse(pattern)
    if tree is None or tree.state.flags & (re.IGNORECASE | re.MULTILINE | re.VERBOSE):
        return None
    items = list(tree)
    if len(items) < 2 or items[0] != (_c.AT, _c.AT_BEGINNING) or items[-1] != (_c.AT, _c.AT_END):
        return None
    words = _finite_sequence(items[1:-1], limit)
    return None if words is None else sorted(words)


def _finite_sequence(items: Iterable, limit: int) -> set[str] | None:
    out = {""}
    for op, av in items:
        part = _finite_item(op, av, limit)
        if part is None:
            return None
        out = {a + b for a in out for b in part}
        if len(out) > limit:
            return None
    return out


def _finite_item(op: Any, av: Any, limit: int) -> set[str] | None:
    if op is _c.LITERAL:
        return {chr(av)}
    if op is _c.IN:
        chars: set[str] = set()
        for kind, value in av:
            if kind is _c.LITERAL:
                chars.add(chr(value))
            elif kind is _c.RANGE and value[1] - value[0] < limit:
                chars.update(chr(c) for c in range(value[0], value[1] + 1))
            else:
                return None
        return chars if len(chars) <= limit else None
    if op is _c.BRANCH:
        out: set[str] = set()
        for branch in av[1]:
            words = _finite_sequence(branch, limit)
            if words is None:
                return None
            out |= words
        return out if len(out) <= limit else None
    if op is _c.SUBPATTERN:
        return None if av[1] or av[2] else _finite_sequence(av[3], limit)  # (?i:…) and other flags
    if op is _c.MAX_REPEAT or op is _c.MIN_REPEAT:
        lo, hi, sub = av
        unit = _finite_sequence(sub, limit)
        if unit is None or hi > limit:
            return None
        out, power = set(), {""}
        for k in range(hi + 1):
            if k >= lo:
                out |= power
            if len(out) > limit:
                return None
            power = {a + b for a in power for b in unit}
            if len(power) > limit * limit:
                return None
        return out
    return None
