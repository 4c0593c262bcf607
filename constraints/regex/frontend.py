"""One front end for every regex a request carries, read as ECMA-262 (JSON Schema's dialect).

JSON Schema ``pattern``s (also under ``propertyNames``) and ``patternProperties`` names, the
``regex`` constraint, the regexes of structural tags and the ``/regex/`` terminals of Lark
grammars all come through here before any backend sees them:

* classes and the dot get their ECMA-262 meaning (:mod:`.dialect`);
* a regex whose only assertions are anchors opening or closing its alternatives (``^a$|b``)
  goes on as written: the backends read those alike;
* anchors anywhere else (``a^b``, ``(^a|b)c``), lookaheads, lookbehinds and ``\\b`` / ``\\B``
  are resolved exactly (:mod:`.automaton`): the backends get a plain regex of the same language
  (``^(?:…)$`` for a pattern). Where that would be too large, a lookaround or word boundary is
  refused naming it and its offset; anchors alone go on as written;
* a backreference is refused, naming it: no regular language does what it does;
* a regex matching no string is an EmptyLanguageError for a ``regex``, and None for a pattern
  (what an empty pattern means depends on where it stands in the schema).

JSON Schema patterns match anywhere in the string (``search``); the other regexes match the
whole text. Refusals are ConstraintErrors (HTTP 400) whose message starts with ``where``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import EmptyLanguageError, InvalidConstraintError, UnsupportedConstraintError
from .analysis import check_regex_nonempty, parse
from .automaton import TooComplex, language
from .dialect import ecma_regex, lark_regexes
from .syntax import ANCHORS, TAG, Construct, scan, tagged

try:  # Python 3.11+
    from re import _constants as _c
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]

_STARTS, _ENDS = ("^", "\\A"), ("$", "\\z", "\\Z")


def schema_pattern(pattern: str, where: str = "pattern", pointer: str | None = None) -> str | None:
    """The regex the backends get for a JSON Schema ``pattern`` (matched anywhere in the
    string), or None when it matches no string. Refusals name ``where`` (and carry ``pointer``)."""
    try:
        kind, text = _resolve_once(pattern, True)
    except (InvalidConstraintError, UnsupportedConstraintError) as exc:
        raise type(exc)(f"{where}: {exc.message}", pointer=pointer, keyword="pattern") from None
    if kind == "empty":
        return None
    return ecma_regex(text if kind == "exact" else pattern, json_string=True)


def full_regex(regex: str, where: str = "regex") -> str:
    """The regex the backends get for a regex matched against the whole text; an
    EmptyLanguageError when it matches no string."""
    try:
        kind, text = _resolve_once(regex, False)
    except (InvalidConstraintError, UnsupportedConstraintError) as exc:
        raise type(exc)(f"{where}: {exc.message}") from None
    if kind == "empty":
        raise EmptyLanguageError("the regex matches no string")
    return text if kind == "exact" else ecma_regex(regex)


def check_lark_terminals(grammar: str) -> None:
    """Refuse the ``/regex/`` terminals of a Lark grammar that use a backreference, a
    lookaround or a word boundary: a terminal is matched on its own, so what such a construct
    would look at lies outside it (the backends would refuse it in their own words)."""
    for offset, regex in lark_regexes(grammar):
        for construct in scan(regex).constructs:
            if not construct.is_anchor:
                raise UnsupportedConstraintError(
                    f"the terminal /{regex[:60]}/ at offset {offset} of the grammar: {construct.describe()}"
                    " is not supported in a grammar terminal"
                )


CACHED_REGEX_CHARS = 4096  # longer client regexes are resolved every time: the cache's keys stay small


def _resolve_once(regex: str, search: bool) -> tuple[str, str | None]:
    """:func:`_resolve`, remembered for regexes up to :data:`CACHED_REGEX_CHARS` characters."""
    return _resolve_cached(regex, search) if len(regex) <= CACHED_REGEX_CHARS else _resolve(regex, search)


def _resolve(regex: str, search: bool) -> tuple[str, str | None]:
    """("plain", None): go on as written; ("exact", a regex of the same language without
    assertions: a pattern when ``search``, else a whole-text regex); ("empty", None). Raises
    the refusals."""
    found = scan(regex)
    if (ref := found.backreference()) is not None:
        raise UnsupportedConstraintError(
            f"{ref.describe()} is not supported: a backreference repeats what a group matched,"
            " which no regular language (and no backend) can enforce"
        )
    if found.quantified is not None:
        raise InvalidConstraintError(f"{found.quantified.describe()} cannot be quantified")
    assertions = [c for c in found.constructs if c.is_assertion]
    hard = [c for c in assertions if not c.is_anchor]
    if not hard and all(_at_edge(regex, c) for c in assertions):
        return _plain(regex, anchors_inside=False)
    tree, tags = _parse(regex, assertions, found)
    if tree is None:
        if hard:
            raise UnsupportedConstraintError(f"{hard[0].describe()} is not supported here: the regex uses syntax"
                                             " the front end cannot analyse (a \\p{…} class, say)")
        return _plain(regex, anchors_inside=True)
    if not hard and _edge_form(list(tree), tags):
        return _plain(regex, anchors_inside=False)
    try:
        lang = language(tree, tags, search)
        if lang.empty():
            return "empty", None
        return "exact", lang.pattern() if search else lang.regex()
    except TooComplex as exc:
        if not hard:  # anchors alone go on as written: llguidance reads them (xgrammar_gaps: not xgrammar)
            return _plain(regex, anchors_inside=True)
        construct = exc.construct or hard[0]
        raise UnsupportedConstraintError(f"{construct.describe()} cannot be enforced exactly: {exc.reason}") from None


def _plain(regex: str, anchors_inside: bool) -> tuple[str, str | None]:
    """A regex the backends read as written; ("empty", None) when it matches no string (with
    anchors only at the edges of its alternatives, only an empty class such as ``[^\\s\\S]``
    can do that)."""
    try:
        if anchors_inside or "[" in regex:
            check_regex_nonempty(ecma_regex(regex))
    except EmptyLanguageError:
        return "empty", None
    return "plain", None


def anchors_at_edges(regex: str) -> bool:
    """Whether every anchor of ``regex`` opens or closes one of its alternatives (xgrammar
    ignores anchors: only there do they mean what it reads, a match of the whole text)."""
    found = scan(regex)
    anchors = [c for c in found.constructs if c.is_anchor]
    if all(_at_edge(regex, c) for c in anchors):
        return True
    tree, tags = _parse(regex, [c for c in found.constructs if c.is_assertion], found)
    return tree is not None and _edge_form(list(tree), tags)


def _at_edge(regex: str, construct: Construct) -> bool:
    """A ``^`` opening or ``$`` closing the whole regex (hence its first / last alternative)."""
    if construct.text in _STARTS:
        return construct.start == 0
    return construct.text in _ENDS and construct.end == len(regex)


def _parse(regex: str, assertions: list[Construct], found: Any) -> tuple[Any, dict[int, tuple[int, Construct]]]:
    """Python's parse tree of the translated regex, and group id -> (index, construct) of each
    tagged assertion; (None, {}) when it cannot be read that way."""
    tree = parse(ecma_regex(tagged(regex, found)))
    if tree is None:
        return None, {}
    tags = {}
    for name, group in tree.state.groupdict.items():
        if name.startswith(TAG) and name[len(TAG):].isdigit():
            index = int(name[len(TAG):])
            tags[group] = (index, found.constructs[index])
    return (tree, tags) if len(tags) == len(assertions) else (None, {})


def _edge_form(items: list, tags: dict[int, tuple[int, Construct]]) -> bool:
    """Whether every tagged assertion (anchors only, here) opens with ``^`` or closes with ``$``
    one alternative of the whole regex (through plain groups)."""
    if len(items) == 1:
        op, av = items[0]
        if op is _c.BRANCH:
            return all(_edge_form(list(branch), tags) for branch in av[1])
        if op is _c.SUBPATTERN and av[0] not in tags and not av[1] and not av[2]:
            return _edge_form(list(av[3]), tags)
    start = 1 if items and _anchor(items[0], tags) in _STARTS else 0
    end = len(items) - 1 if len(items) > start and _anchor(items[-1], tags) in _ENDS else len(items)
    return not any(_has_tag(item, tags) for item in items[start:end])


def _anchor(item: tuple, tags: dict[int, tuple[int, Construct]]) -> str | None:
    op, av = item
    if op is _c.SUBPATTERN and av[0] in tags and tags[av[0]][1].text in ANCHORS:
        return tags[av[0]][1].text
    return None


def _has_tag(item: tuple, tags: dict[int, tuple[int, Construct]]) -> bool:
    op, av = item
    if op is _c.SUBPATTERN:
        return av[0] in tags or any(_has_tag(x, tags) for x in av[3])
    if op is _c.BRANCH:
        return any(_has_tag(x, tags) for branch in av[1] for x in branch)
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        return any(_has_tag(x, tags) for x in av[2])
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return True
    return op is _c.AT


_resolve_cached = lru_cache(maxsize=1024)(_resolve)
