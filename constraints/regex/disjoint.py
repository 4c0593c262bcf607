"""Can one string match two JSON Schema ``pattern``s? Decided exactly on DFAs (interegular).

A ``pattern`` matches a string when the regex matches *somewhere* in it (ECMA-262 search
semantics), so each pattern stands for the language ``[\\s\\S]*P[\\s\\S]*`` with a leading ``^`` /
trailing ``$`` dropping that side's ``[\\s\\S]*``. Two patterns are disjoint when the
intersection of their languages is empty. The answer is "disjoint" only when every step is
certain: a pattern with inner anchors, lookarounds, back-references, flags, or syntax
interegular does not parse, or one too long to build a DFA for cheaply, is never called
disjoint (the caller then refuses or keeps looking).
"""

from __future__ import annotations

import re
from functools import lru_cache

from .analysis import has_anchors

MAX_PATTERN_CHARS = 400  # longer patterns are not turned into DFAs here
# patterns_disjoint builds each DFA once (cached) and only intersects, so one long pattern (the
# ``uri`` format's, 2,348 characters, 726 states in 0.6 s; a long list of alternatives) is worth
# deciding against a short one (at most MAX_PATTERN_CHARS); two long ones are not tried
MAX_DISJOINT_PATTERN_CHARS = 4_000
_ANY = r"[\s\S]*"
# constructs whose meaning interegular may not share with ECMA-262: groups with flags or
# lookarounds, back-references, word boundaries, \p classes, \c controls
_UNSAFE = re.compile(r"\(\?(?!:)|\\[1-9bBpPkc]")
# \uXXXX / \UXXXXXXXX (as ecma_regex writes classes), which interegular does not read
_CODEPOINT = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _interegular_syntax(pattern: str) -> str:
    """``pattern`` with code point escapes written as interegular reads them: ``\\xHH`` below
    U+0100 (some of those are regex syntax), the character itself above."""
    def one(m: re.Match) -> str:
        cp = int(m.group(2) or m.group(3), 16)
        return m.group(1) + (f"\\x{cp:02x}" if cp < 0x100 else chr(cp))

    return _CODEPOINT.sub(one, pattern)


def patterns_disjoint(a: str, b: str) -> bool:
    """True only when no string contains a match of both ``a`` and ``b`` (ECMA-normalised
    patterns, as :func:`constraints.regex.dialect.ecma_regex` writes them)."""
    if min(len(a), len(b)) > MAX_PATTERN_CHARS:
        return False  # two long ones: their product is where the time goes
    fa, fb = pattern_language(a, MAX_DISJOINT_PATTERN_CHARS), pattern_language(b, MAX_DISJOINT_PATTERN_CHARS)
    if fa is None or fb is None:
        return False
    try:
        return (fa & fb).empty()
    except Exception:  # interegular gave up on the product: nothing is promised
        return False


def pattern_language(pattern: str, limit: int = MAX_PATTERN_CHARS):
    """The DFA of the strings ``pattern`` accepts (search semantics), or None (also for a
    pattern longer than ``limit``)."""
    return None if len(pattern) > limit else _pattern_language(pattern)


@lru_cache(maxsize=256)  # keys are client patterns of at most a caller's limit (4,000 characters)
def _pattern_language(pattern: str):
    if _UNSAFE.search(pattern):
        return None
    body, anchored_start, anchored_end = _strip_outer_anchors(pattern)
    if body is None:
        return _alternatives_language(pattern)
    if has_anchors(body):
        return None
    body = _interegular_syntax(body)
    full = ("" if anchored_start else _ANY) + f"(?:{body})" + ("" if anchored_end else _ANY)
    try:
        import interegular

        return interegular.parse_pattern(full).to_fsm()
    except Exception:
        return None


def match_progress(pattern: str, text: str) -> str | None:
    """How far a string starting with ``text`` is from containing a match of ``pattern`` (as
    :func:`patterns_disjoint` reads it): ``"dead"`` when no continuation matches, ``"safe"``
    when every continuation can still match, else ``"live"``; None when the pattern has no DFA
    here."""
    fsm = pattern_language(pattern)
    if fsm is None:
        return None
    state = fsm.initial
    for ch in text:
        state = fsm.map.get(state, {}).get(fsm.alphabet[ch])
        if state is None:
            return "dead"
    live, safe = _state_kinds(pattern)
    return "safe" if state in safe else "live" if state in live else "dead"


@lru_cache(maxsize=256)
def unbounded_completions(pattern: str) -> bool | None:
    """Whether every prefix of a string matching ``pattern`` has infinitely many completions
    that match (so finitely many used strings can never leave a prefix with no way on); None
    when the pattern has no DFA here."""
    fsm = pattern_language(pattern)
    if fsm is None:
        return None
    live, _ = _state_kinds(pattern)
    reachable, stack = {fsm.initial}, [fsm.initial]
    while stack:
        for target in fsm.map.get(stack.pop(), {}).values():
            if target in live and target not in reachable:
                reachable.add(target)
                stack.append(target)
    # states on a cycle of live states, then every state that reaches one
    on_cycle = {s for s in reachable if _reaches(fsm, live, s, s)}
    endless = set(on_cycle)
    grew = True
    while grew:
        grew = False
        for state in reachable - endless:
            if any(t in endless for t in fsm.map.get(state, {}).values()):
                endless.add(state)
                grew = True
    return reachable <= endless


def _reaches(fsm, live: frozenset, start, goal) -> bool:
    """Whether ``goal`` is reached from ``start`` in one or more steps through live states."""
    seen, stack = set(), [t for t in fsm.map.get(start, {}).values() if t in live]
    while stack:
        state = stack.pop()
        if state == goal:
            return True
        if state not in seen:
            seen.add(state)
            stack.extend(t for t in fsm.map.get(state, {}).values() if t in live)
    return False


def live_states(fsm) -> set:
    """The states of an interegular ``fsm`` from which a final state can be reached."""
    live = set(fsm.finals)
    grew = True
    while grew:
        grew = False
        for state, moves in fsm.map.items():
            if state not in live and any(target in live for target in moves.values()):
                live.add(state)
                grew = True
    return live


@lru_cache(maxsize=256)
def _state_kinds(pattern: str) -> tuple[frozenset, frozenset]:
    """The states of the pattern's DFA from which a final state can be reached (live), and
    those from which every reachable state is live and no symbol leads nowhere (safe)."""
    fsm = pattern_language(pattern)
    live = live_states(fsm)
    symbols = set(fsm.alphabet.by_transition) if hasattr(fsm.alphabet, "by_transition") else None
    safe = {s for s in live if symbols is not None and set(fsm.map.get(s, {})) >= symbols}
    shrank = True
    while shrank:
        shrank = False
        for state in list(safe):
            if any(target not in safe for target in fsm.map.get(state, {}).values()):
                safe.discard(state)
                shrank = True
    return frozenset(live), frozenset(safe)


def _strip_outer_anchors(pattern: str) -> tuple[str | None, bool, bool]:
    """(pattern without a leading ``^`` / trailing unescaped ``$``, had ^, had $); body None
    when an anchor belongs to a top-level alternative only (``^a|b``)."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = body.endswith("$") and not re.search(r"(?<!\\)(\\\\)*\\\$$", body)
    body = body[:-1] if end else body
    if (start or end) and top_level_alternation(body):
        return None, start, end
    return body, start, end


def _alternatives_language(pattern: str):
    """The union of the languages of ``pattern``'s top-level alternatives, for a pattern whose
    anchors belong to some of them (``,,|^,|,$``): a string holds a match of the pattern
    exactly when it holds a match of one alternative. None when one has no DFA here."""
    alternatives = top_level_alternatives(pattern)
    if len(alternatives) < 2:
        return None
    languages = [_pattern_language(a) for a in alternatives]
    if any(language is None for language in languages):
        return None
    try:
        union = languages[0]
        for language in languages[1:]:
            union = union | language
        return union.reduce()
    except Exception:  # interegular gave up: nothing is promised
        return None


def top_level_alternatives(pattern: str) -> list[str]:
    """``pattern`` split at its top-level ``|`` (outside groups and classes)."""
    parts, start, depth, escaped, in_class = [], 0, 0, False, False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    return [*parts, pattern[start:]]


def top_level_alternation(body: str) -> bool:
    """Whether ``body`` has a ``|`` at its top level."""
    return len(top_level_alternatives(body)) > 1
