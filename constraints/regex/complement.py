"""The complement of a JSON Schema ``pattern``, as a pattern: ``not: {"pattern": P}``.

Neither backend can negate a regex in a JSON schema, so ``not`` over a ``pattern`` (and a
``oneOf`` over patterns, which needs each branch negated) was refused. Here the strings ``P``
does not match (ECMA-262 search semantics) are built as a DFA (interegular: the language of
``P`` as :mod:`constraints.regex.disjoint` builds it, complemented), and the DFA is written back
as a regex by state elimination. The result is checked: its own DFA must equal the complement,
or no pattern is given (the caller then refuses as before). Large DFAs or results are not
attempted: state elimination can grow a regex exponentially.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .dialect import class_items, ecma_regex, point_ranges
from .disjoint import live_states, pattern_language, top_level_alternation

MAX_STATES = 64  # complement DFAs larger than this are not written out (elimination stops past MAX_PATTERN_CHARS)
MAX_PATTERN_CHARS = 4_000  # nor are results longer than this
MAX_REMEMBERED = 1_024
# complement -> the pattern it was written for, so that "not not P" is P as written (llguidance
# cannot always tell whether an intersection of long written-out complements is empty); kept for
# one schema rewrite at a time (forget_complements), so a result never depends on earlier requests
_COMPLEMENTED: dict[str, str] = {}


def forget_complements() -> None:
    """Start a schema rewrite with no complements remembered."""
    _COMPLEMENTED.clear()


def complement_pattern(pattern: str) -> str | None:
    """A pattern (ECMA-normalised, anchored) matching exactly the strings ``pattern`` matches
    nowhere, or None when that cannot be written here."""
    if pattern in _COMPLEMENTED:  # not (not P) = P, as written
        return _COMPLEMENTED[pattern]
    language = pattern_language(pattern, limit=MAX_PATTERN_CHARS)
    if language is None:
        return None
    try:
        negated = trimmed(language.everythingbut().reduce())
    except Exception:  # interegular gave up somewhere: nothing is promised
        return None
    result = written_pattern(negated)
    if result is None:
        return None
    if len(_COMPLEMENTED) >= MAX_REMEMBERED:
        _COMPLEMENTED.clear()
    _COMPLEMENTED[result] = pattern
    return result


def written_pattern(fsm: Any) -> str | None:
    """A pattern (ECMA-normalised, anchored, for a JSON string's content) matching exactly the
    whole strings ``fsm`` (trimmed, :func:`trimmed`) accepts, checked against it; None when the
    DFA or the result is too large, or the check fails."""
    if fsm is None or len(fsm.states) > MAX_STATES:
        return None
    try:
        body = eliminate(fsm)
        if body is None:
            return None
        plain = ecma_regex(f"^(?:{body})$")
        if len(plain) > MAX_PATTERN_CHARS:
            return None
        written = pattern_language(plain, limit=MAX_PATTERN_CHARS)
        if written is None or not (written ^ fsm).empty():
            return None
        # as a JSON string's pattern: the llguidance quoting workaround (never a NUL there)
        return ecma_regex(f"^(?:{body})$", json_string=True)
    except Exception:  # interegular gave up somewhere: nothing is promised
        return None


def trimmed(fsm: Any) -> Any:
    """``fsm`` without the states from which no final state can be reached (None when that
    leaves nothing: the complement is empty, which ``not`` handles on its own)."""
    live = live_states(fsm)
    if fsm.initial not in live:
        return None
    from interegular.fsm import FSM

    return FSM(alphabet=fsm.alphabet, states=live, initial=fsm.initial, finals=set(fsm.finals) & live,
               map={s: {t: q for t, q in fsm.map[s].items() if q in live} for s in live if s in fsm.map})


def eliminate(fsm: Any, label: Callable[[Any, list[int]], str] | None = None,
              max_chars: int = MAX_PATTERN_CHARS, by_length: bool = False) -> str | None:
    """The regex of ``fsm``'s language by state elimination (edges hold regex strings), or None
    past ``max_chars``; ``label(alphabet, transitions)`` writes the class of one edge (by
    default: the characters of an interegular alphabet, see :func:`_label`). The state
    eliminated next is the one with the fewest paths through it, or (``by_length``) the one
    whose elimination writes the least text, which keeps counted repeats far shorter."""
    label = label or _label
    cost = _text_written if by_length else _degree
    start, end = object(), object()
    edges: dict[Any, dict[Any, str]] = {start: {fsm.initial: ""}}
    for state, moves in fsm.map.items():
        by_target: dict[Any, list[int]] = {}
        for transition, target in moves.items():
            by_target.setdefault(target, []).append(transition)
        edges[state] = {target: label(fsm.alphabet, ts) for target, ts in by_target.items()}
    for state in fsm.finals:
        out = edges.setdefault(state, {})
        out[end] = _union(out[end], "") if end in out else ""
    remaining = set(fsm.states)
    while remaining:
        state = min(remaining, key=lambda s: cost(edges, s))
        remaining.discard(state)
        loop = edges.get(state, {}).pop(state, None)
        middle = f"(?:{loop})*" if loop else ""
        outgoing = edges.pop(state, {})
        for source, out in edges.items():
            if state not in out:
                continue
            into = out.pop(state)
            for target, text in outgoing.items():
                path = _concat(into, middle, text)
                out[target] = _union(out[target], path) if target in out else path
        if sum(len(text) for out in edges.values() for text in out.values()) > max_chars:
            return None
    return edges[start].get(end)


def _degree(edges: dict, state: Any) -> int:
    into = sum(1 for out in edges.values() if state in out)
    return into * len(edges.get(state, {}))


def _text_written(edges: dict, state: Any) -> int:
    """About how much text eliminating ``state`` writes: each label into it once per way out,
    each label out of it once per way in, its loop once per pair."""
    into = [out[state] for source, out in edges.items() if state in out and source is not state]
    outs = [text for target, text in edges.get(state, {}).items() if target is not state]
    loop = len(edges.get(state, {}).get(state, ""))
    return (sum(map(len, into)) * len(outs) + sum(map(len, outs)) * len(into)
            + loop * len(into) * len(outs))


def _label(alphabet: Any, transitions: list[int]) -> str:
    """The character class of the characters that take any of ``transitions``; the transition
    of every character the pattern does not name makes it a negated class of named ones."""
    from interegular.fsm import anything_else

    chars = [c for t in transitions for c in alphabet.by_transition[t]]
    points = {ord(c) for c in chars if c is not anything_else}
    if anything_else in chars:
        others = sorted(ord(c) for c in alphabet.keys() if c is not anything_else and ord(c) not in points)
        if others:
            return f"[^{class_items(point_ranges(others))}]"
        # every character: a named one or any other (not [\s\S], which interegular would
        # spell out character by character when checking the result)
        named = class_items(point_ranges(sorted(points)) or [(0, 0)])
        return f"(?:[{named}]|[^{named}])"
    return f"[{class_items(point_ranges(sorted(points)))}]"


def _union(a: str, b: str) -> str:
    return a if a == b else f"(?:{a}|{b})"


def _concat(*parts: str) -> str:
    return "".join(f"(?:{p})" if top_level_alternation(p) else p for p in parts)
