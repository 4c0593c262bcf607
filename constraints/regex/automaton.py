"""The exact language of a regex with anchors, lookarounds and word boundaries, as a DFA.

An assertion (``^ $ \\b \\B``, a lookahead or lookbehind) is a condition on the text left and
right of where it stands. Each one is written as a *marker* symbol in its place, which makes
the regex an ordinary one: its marked language M. An occurrence of a marker *fails* when the
text before it is in a left language and the text after it in a right one (for a lookahead
``(?=A)``: any text, and a text not starting with a match of A). The regex's language is
the words of M in which no occurrence fails, with the markers erased; one product crawl
finds those words (:func:`_holding`).

A lookahead's body is itself a language of the text from its position to the end (``A·Σ*``),
so the assertions inside it may look right (``$``, lookaheads); ``^``, ``\\b`` and ``\\B`` look
one character back at most, so the body's language is built once per context (at the start,
after a word character, after another one) and each paired with the texts before that end
so. A lookbehind's body (``Σ*·B``) likewise holds ``^``, lookbehinds, and ``$``, ``\\b``, ``\\B``
per context after it. A lookbehind inside a lookahead (or the reverse) is refused
(:class:`TooComplex`).

Characters are atoms (:mod:`.atoms`): ``[^a]`` costs one symbol, not a million. Automata are
built as NFAs and made deterministic once (:mod:`.nfa`). A DFA is written back as a regex by state elimination
(:func:`constraints.regex.complement.eliminate`), and the text is checked: its own DFA must
accept what the DFA it was written from accepts.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from interegular.fsm import FSM, Alphabet

from .analysis import parse
from .atoms import CHARS, Atoms, char_set, char_sets, dotall_in
from .complement import eliminate, trimmed
from .dialect import WORD
from .nfa import Fragment, Nfa, TooLarge, crawl, determinize, minimize, reverse, same
from .nfa import complement as complement_fsm
from .syntax import LOOKAROUNDS, Construct

try:  # Python 3.11+
    from re import _constants as _c
except ImportError:  # pragma: no cover
    import sre_constants as _c  # type: ignore[no-redef]

MAX_STATES = 1_000  # any DFA built on the way
MAX_NFA_STATES = 20_000
MAX_PATTERN_CHARS = 20_000  # a written regex longer than this is not handed to a backend
_STARTS, _ENDS, _BOUNDARIES = ("^", "\\A"), ("$", "\\z", "\\Z"), ("\\b", "\\B")
_RIGHT = frozenset({*_ENDS, *_STARTS, *_BOUNDARIES, "(?=", "(?!"})  # what a lookahead's body may hold
_LEFT = frozenset({*_STARTS, *_ENDS, *_BOUNDARIES, "(?<=", "(?<!"})  # ... and a lookbehind's
_ALLOWED_FLAGS = re.DOTALL | re.UNICODE
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)


class TooComplex(Exception):
    """No exact DFA within the limits: ``reason`` says why, ``construct`` (when known) names
    the assertion it concerns."""

    def __init__(self, reason: str, construct: Construct | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.construct = construct


@dataclass
class _Level:
    """The assertions of one language being built: the top, or a lookaround's body."""

    allowed: frozenset[str] | None = None  # None: every kind
    inside: Construct | None = None
    failing: dict[int, list[tuple[FSM, FSM]]] = field(default_factory=dict)  # marker key -> (left, right)


def language(tree: Any, tags: dict[int, tuple[int, Construct]], search: bool) -> Language:
    """The exact language of the parsed regex ``tree`` (``tags``: group id -> index and
    construct of each tagged assertion), matched anywhere in the text (``search``, JSON
    Schema's ``pattern``) or as the whole text. Raises TooComplex."""
    flags = tree.state.flags
    if flags & ~_ALLOWED_FLAGS:
        raise TooComplex("inline flags other than (?s) are not supported here")
    builder = _Builder(tree, tags, bool(flags & re.DOTALL))
    return Language(builder, builder.language(list(tree), search, search, _Level()))


class Language:
    """A regex's DFA (minimal) and how to write it back."""

    def __init__(self, builder: _Builder, fsm: FSM) -> None:
        self._builder = builder
        self.fsm = fsm

    def empty(self) -> bool:
        return self.fsm.empty()

    def regex(self) -> str:
        """A plain regex (classes, groups, repeats) whose whole-text matches are exactly this
        language; TooComplex when it is too long to write."""
        return self._builder.write(self.fsm)

    def pattern(self) -> str:
        """A JSON Schema ``pattern`` (matched anywhere) for this language of whole texts,
        anchored at both ends (xgrammar reads every pattern as a whole-text match). Where any
        text before (after) a word keeps it in the language, the core is written without that
        context and an explicit "any text" stands before (after) it."""
        core, texts = self.fsm, self._builder.text
        after = _right_closed(core, texts)
        before = _left_closed(core, texts)
        try:
            if after:  # the words of the language with no proper prefix in it ...
                core = _to_first_final(core)
            if before:  # ... nor a proper suffix
                core = reverse(_to_first_final(reverse(core, MAX_STATES)), MAX_STATES)
        except TooLarge:
            raise TooComplex(f"its exact automaton has more than {MAX_STATES} states") from None
        body = self._builder.write(core)
        anything = f"{self._builder.atoms.every_char()}*"
        return f"^(?:{anything if before else ''}(?:{body}){anything if after else ''})$"


class _Builder:
    def __init__(self, tree: Any, tags: dict[int, tuple[int, Construct]], dotall: bool) -> None:
        self.tags = tags
        try:
            sets = {tuple(ranges): None for ranges in char_sets(list(tree), dotall)}
        except ValueError as exc:
            raise TooComplex(str(exc)) from None
        if any(c.text in _BOUNDARIES for _, c in tags.values()):
            sets[tuple(WORD)] = None
        self.atoms = Atoms([list(s) for s in sets])
        self.dotall = dotall
        self.text = list(range(len(self.atoms)))  # transition keys of characters ...
        self.marker = {index: len(self.atoms) + index for index, _ in tags.values()}  # ... and of markers
        symbols = {("a", i): i for i in self.text} | {("m", i): key for i, key in self.marker.items()}
        self.alphabet = Alphabet(symbols)
        self.every = self._dfa(lambda nfa: nfa.star(nfa.chars(self.text)))
        self.plus = self._dfa(lambda nfa: nfa.concat([nfa.chars(self.text), nfa.star(nfa.chars(self.text))]))

    # -- languages ------------------------------------------------------------------------------

    def language(self, items: list, before: bool, after: bool, level: _Level, lead: list[int] | None = None,
                 trail: list[int] | None = None) -> FSM:
        """The minimal DFA of the texts ``items`` matches (with any text before / after it, and
        one character of ``lead`` / ``trail`` around all), its assertions resolved."""
        nfa = Nfa()
        parts = [nfa.chars(lead)] if lead else []
        parts += [nfa.star(nfa.chars(self.text))] if before else []
        parts.append(self._items(nfa, items, level, self.dotall))
        parts += [nfa.star(nfa.chars(self.text))] if after else []
        parts += [nfa.chars(trail)] if trail else []
        marked = self._det(nfa, nfa.concat(parts), level.inside)
        if not level.failing:
            return self._min(marked, level.inside)
        conditions = [(key, left, right) for key, pairs in level.failing.items() for left, right in pairs]
        try:
            good = trimmed(_holding(marked, self.text, list(level.failing), conditions))
        except TooLarge:
            raise _too_many(level.inside) from None
        if good is None:
            return FSM(alphabet=self.alphabet, states={0}, initial=0, finals=set(), map={0: {}})
        return self._min(self._det(*_erased(good, set(level.failing)), level.inside), level.inside)

    def _items(self, nfa: Nfa, items: Any, level: _Level, dotall: bool) -> Fragment:
        if len(nfa.moves) > MAX_NFA_STATES:
            raise TooComplex("the regex is too large to resolve exactly", level.inside)
        parts: list[Fragment] = []
        for is_char, run in itertools.groupby(items, key=lambda item: item[0] in CHARS):
            if is_char:  # a run of characters: one chain, no empty moves (they cost the subsets)
                parts.append(nfa.chain([self.atoms.of(char_set(op, av, dotall)) for op, av in run]))
            else:
                parts += [self._item(nfa, op, av, level, dotall) for op, av in run]
        return nfa.concat(parts)

    def _item(self, nfa: Nfa, op: Any, av: Any, level: _Level, dotall: bool) -> Fragment:
        if op is _c.BRANCH:
            return nfa.union([self._items(nfa, branch, level, dotall) for branch in av[1]])
        if op is _c.SUBPATTERN:
            group, add, remove, sub = av
            if group in self.tags:
                return self._assertion(nfa, *self.tags[group], sub, level)
            if (add | remove) & ~_ALLOWED_FLAGS:
                raise TooComplex("inline flags other than (?s) are not supported here")
            return self._items(nfa, sub, level, dotall_in(dotall, add, remove))
        if op in _REPEATS:
            lo, hi, sub = av
            return self._repeat(nfa, lambda: self._items(nfa, sub, level, dotall), lo, hi, level)
        raise TooComplex(f"the construct {str(op).lower()} is not supported here", level.inside)

    def _repeat(self, nfa: Nfa, build: Callable[[], Fragment], lo: int, hi: int, level: _Level) -> Fragment:
        unbounded = hi == _c.MAXREPEAT
        if (lo if unbounded else hi) > MAX_NFA_STATES:
            raise TooComplex(f"a repeat count of {lo if unbounded else hi} is too large here", level.inside)
        parts = [build() for _ in range(lo)]
        if unbounded:
            parts.append(nfa.star(build()))
        else:
            parts.extend(nfa.optional(build()) for _ in range(hi - lo))
        return nfa.concat(parts)

    def _assertion(self, nfa: Nfa, index: int, construct: Construct, sub: list, level: _Level) -> Fragment:
        if level.allowed is not None and construct.text not in level.allowed:
            other = "lookbehind" if level.allowed is _RIGHT else "lookahead"
            where = level.inside.describe() if level.inside else "lookaround"
            raise TooComplex(f"a {other} inside the {where} is not supported", construct)
        key = self.marker[index]
        if key not in level.failing:
            level.failing[key] = self._failing(construct, sub)
        return nfa.chars([key])

    def _failing(self, construct: Construct, sub: list) -> list[tuple[FSM, FSM]]:
        """(left, right) text languages around the assertion under which it fails."""
        every, plus, text = self.every, self.plus, construct.text
        if text in _STARTS:
            return [(plus, every)]
        if text in _ENDS:
            return [(every, plus)]
        if text in LOOKAROUNDS:
            return self._lookaround(construct, sub[0][1][1])  # (ASSERT, (direction, items))
        ends_word, ends_other, starts_word, starts_other = self._word_edges()
        if text == "\\b":
            return [(ends_word, starts_word), (ends_other, starts_other)]
        return [(ends_word, starts_other), (ends_other, starts_word)]

    def _lookaround(self, construct: Construct, body: list) -> list[tuple[FSM, FSM]]:
        """The failing pairs of a lookaround: its body's texts (or the others) beside the
        texts on the other side, per context of one character where the body needs it."""
        ahead = construct.text in ("(?=", "(?!")
        positive = construct.text in ("(?=", "(?<=")
        pairs = []
        for side, context in self._contexts(construct, body, ahead):
            level = _Level(_RIGHT if ahead else _LEFT, construct)
            if ahead:
                found = self.language(body, False, True, level, lead=context)
                found = self._min(self._det(*_after_first(found, context), construct), construct) if context else found
            else:
                found = self.language(body, True, False, level, trail=context)
                found = self._min(_before_last(found, context), construct) if context else found
            other = self._complement(found, construct) if positive else found
            pairs.append((side, other) if ahead else (other, side))
        return pairs

    def _contexts(self, construct: Construct, body: list, ahead: bool) -> list[tuple[FSM, list[int] | None]]:
        """(texts on the far side, characters standing for their last / first one) for each
        context the body tells apart: any text, or else the edge of the text and others, or
        the edge, a word character and another character."""
        found = {c.text for c in _tagged(body, self.tags)}
        if found.isdisjoint(_BOUNDARIES):
            if found.isdisjoint(_STARTS if ahead else _ENDS):
                return [(self.every, None)]
            return [(self._dfa(lambda nfa: nfa.nothing()), None), (self.plus, self.text)]
        word = self.atoms.of(WORD)
        other = [i for i in self.text if i not in word]
        if ahead:  # texts before the lookahead: ending with a word character, or another one
            near = self._dfa(lambda nfa: nfa.concat([nfa.star(nfa.chars(self.text)), nfa.chars(word)]))
            far = self._dfa(lambda nfa: nfa.concat([nfa.star(nfa.chars(self.text)), nfa.chars(other)]))
        else:  # texts after the lookbehind: starting with a word character, or another one
            near = self._dfa(lambda nfa: nfa.concat([nfa.chars(word), nfa.star(nfa.chars(self.text))]))
            far = self._dfa(lambda nfa: nfa.concat([nfa.chars(other), nfa.star(nfa.chars(self.text))]))
        return [(self._dfa(lambda nfa: nfa.nothing()), None), (near, word), (far, other)]

    def _word_edges(self) -> tuple[FSM, FSM, FSM, FSM]:
        """Texts ending with a word character, ending otherwise (or empty), starting with a
        word character, starting otherwise (or empty)."""
        word = self.atoms.of(WORD)
        ends_word = self._dfa(lambda nfa: nfa.concat([nfa.star(nfa.chars(self.text)), nfa.chars(word)]))
        starts_word = self._dfa(lambda nfa: nfa.concat([nfa.chars(word), nfa.star(nfa.chars(self.text))]))
        return ends_word, self._complement(ends_word, None), starts_word, self._complement(starts_word, None)

    # -- automata -------------------------------------------------------------------------------

    def _dfa(self, build: Callable[[Nfa], Fragment]) -> FSM:
        nfa = Nfa()
        return self._det(nfa, build(nfa), None)

    def _det(self, nfa: Nfa, part: Fragment, construct: Construct | None) -> FSM:
        try:
            return determinize(nfa, part, self.alphabet, MAX_STATES)
        except TooLarge:
            raise _too_many(construct) from None

    def _min(self, fsm: FSM, construct: Construct | None) -> FSM:
        try:
            return minimize(fsm, MAX_STATES)
        except TooLarge:
            raise _too_many(construct) from None

    def _complement(self, fsm: FSM, construct: Construct | None) -> FSM:
        try:
            return complement_fsm(fsm, self.text, MAX_STATES)
        except TooLarge:
            raise _too_many(construct) from None

    # -- writing --------------------------------------------------------------------------------

    def write(self, fsm: FSM) -> str:
        """A plain regex of ``fsm``'s language, checked; TooComplex when too long to write."""
        live = trimmed(self._min(fsm, None))
        if live is None:
            return "[^\\u0000-\\U0010ffff]"
        body = eliminate(live, self.label, MAX_PATTERN_CHARS, by_length=True)
        if body is None or len(body) > MAX_PATTERN_CHARS:
            raise TooComplex(f"its exact form is longer than {MAX_PATTERN_CHARS} characters")
        if not self._same_language(body, live):
            raise TooComplex("its exact form could not be written")
        return body

    def label(self, alphabet: Alphabet, transitions: list[int]) -> str:
        """The class of the characters taking any of ``transitions`` (for state elimination)."""
        return self.atoms.label([i for t in transitions for kind, i in alphabet.by_transition[t] if kind == "a"])

    def _same_language(self, body: str, fsm: FSM) -> bool:
        """Whether the plain regex ``body`` (as :meth:`label` writes classes) spells ``fsm``."""
        tree = parse(body)
        if tree is None:
            return False
        try:
            written = self._dfa(lambda nfa: self._items(nfa, list(tree), _Level(), True))
            return same(written, fsm, self.text, MAX_STATES * MAX_STATES)
        except (TooComplex, TooLarge, KeyError):
            return False


def _too_many(construct: Construct | None) -> TooComplex:
    return TooComplex(f"its exact automaton has more than {MAX_STATES} states", construct)


# -- assertions ---------------------------------------------------------------------------------

Condition = tuple[int, FSM, FSM]  # marker key, and left / right texts under which it fails


def _holding(marked: FSM, text: list[int], markers: list[int], conditions: list[Condition]) -> FSM:
    """The words of ``marked`` in which no marker occurrence fails (markers kept). One product
    crawl: ``marked``, each condition's left DFA over the text so far, and the right DFA
    states of the occurrences whose text before was in that left language (at most one for
    an assertion met once per word); a word is bad when one of those ends in a final state.

    Kept small: a word is dropped as soon as a right DFA state accepts every continuation, and
    a left DFA is forgotten once its marker cannot occur any more."""
    conditions = [(m, left, right) for m, left, right in
                  ((m, trimmed(left), trimmed(right)) for m, left, right in conditions)
                  if left is not None and right is not None]
    doomed = [_universal(right, text) for _, _, right in conditions]
    ahead = _markers_ahead(marked, set(markers))

    def step(fsm: FSM, state: Any, key: int) -> Any:
        return None if state is None else fsm.map.get(state, {}).get(key)

    def follow(state: tuple, key: int) -> tuple | None:
        at, lefts, pending = state
        at = step(marked, at, key)
        if at is None:
            return None
        if key in markers:  # markers are no text: the left and right DFAs stay where they are
            pending = tuple(p | {right.initial} if m == key and left_at in left.finals else p
                            for (m, left, right), left_at, p in zip(conditions, lefts, pending))
        else:
            lefts = tuple(step(left, s, key) for (_, left, _), s in zip(conditions, lefts))
            pending = tuple(frozenset(t for q in p if (t := step(right, q, key)) is not None)
                            for (_, _, right), p in zip(conditions, pending))
        if any(p & lost for p, lost in zip(pending, doomed)):
            return None
        lefts = tuple(s if m in ahead[at] else None for (m, _, _), s in zip(conditions, lefts))
        return at, lefts, pending

    def holds(state: tuple) -> bool:
        at, _, pending = state
        return at in marked.finals and not any(p & right.finals for (_, _, right), p in zip(conditions, pending))

    start = (marked.initial, tuple(left.initial for _, left, _ in conditions), tuple(frozenset() for _ in conditions))
    return crawl(marked.alphabet, text + markers, start, follow, holds, MAX_STATES)


def _tagged(items: Any, tags: dict[int, tuple[int, Construct]]) -> list[Construct]:
    """The tagged assertions inside ``items`` (lookaround bodies included)."""
    out = []
    for op, av in items:
        if op is _c.SUBPATTERN:
            if av[0] in tags:
                out.append(tags[av[0]][1])
            out += _tagged(av[3], tags)
        elif op is _c.BRANCH:
            out += [c for branch in av[1] for c in _tagged(branch, tags)]
        elif op in _REPEATS:
            out += _tagged(av[2], tags)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            out += _tagged(av[1], tags)
    return out


def _after_first(fsm: FSM, keys: list[int]) -> tuple[Nfa, Fragment]:
    """An NFA of the words of ``fsm`` that follow a first character with one of ``keys``."""
    nfa = Nfa()
    entry, ((_, exit_), number) = nfa.state(), nfa.embed(fsm)
    first = fsm.map.get(fsm.initial, {})
    nfa.empty[entry].extend(number[first[key]] for key in keys if key in first)
    return nfa, (entry, exit_)


def _before_last(fsm: FSM, keys: list[int]) -> FSM:
    """The words of ``fsm`` that precede a last character with one of ``keys``."""
    finals = {q for q, moves in fsm.map.items() if any(moves.get(key) in fsm.finals for key in keys)}
    return FSM(alphabet=fsm.alphabet, states=set(fsm.states), initial=fsm.initial, finals=finals, map=fsm.map)


def _erased(fsm: FSM, markers: set[int]) -> tuple[Nfa, Fragment]:
    """An NFA of ``fsm``'s words with the ``markers`` erased (their moves made empty)."""
    nfa = Nfa()
    number = {state: nfa.state() for state in fsm.states}
    exit_ = nfa.state()
    for state, moves in fsm.map.items():
        for key, target in moves.items():
            if key in markers:
                nfa.empty[number[state]].append(number[target])
            else:
                nfa.moves[number[state]].append((key, number[target]))
    for state in fsm.finals:
        nfa.empty[number[state]].append(exit_)
    return nfa, (number[fsm.initial], exit_)


def _universal(fsm: FSM, keys: list[int]) -> frozenset:
    """The states of ``fsm`` from which every text over the transitions ``keys`` is accepted."""
    good = {q for q in fsm.finals if all(k in fsm.map.get(q, {}) for k in keys)}
    changed = True
    while changed:
        bad = {q for q in good if any(fsm.map[q][k] not in good for k in keys)}
        good -= bad
        changed = bool(bad)
    return frozenset(good)


def _markers_ahead(fsm: FSM, markers: set[int]) -> dict[Any, frozenset]:
    """For each state of ``fsm``, the marker keys some path from it still reads."""
    ahead = {q: {k for k in fsm.map.get(q, {}) if k in markers} for q in fsm.states}
    changed = True
    while changed:
        changed = False
        for q in fsm.states:
            for target in fsm.map.get(q, {}).values():
                if not ahead[target] <= ahead[q]:
                    ahead[q] |= ahead[target]
                    changed = True
    return {q: frozenset(found) for q, found in ahead.items()}


# -- closure under context (for patterns) -------------------------------------------------------


def _right_closed(fsm: FSM, keys: list[int]) -> bool:
    """Whether any text after a word of the (trimmed) ``fsm`` keeps it in the language."""
    universal = _universal(fsm, keys)
    return all(q in universal for q in fsm.finals)


def _left_closed(fsm: FSM, keys: list[int]) -> bool:
    """Whether any text before a word of the (trimmed) ``fsm`` keeps it in the language: one
    character does (c·L ⊆ L for every c), i.e. the initial state's language is included in
    that of each state one character on."""
    moves = fsm.map.get(fsm.initial, {})
    return all(k in moves and _included(fsm, fsm.initial, moves[k]) for k in keys)


def _included(fsm: FSM, p: Any, q: Any) -> bool:
    """Whether state ``p``'s language is part of state ``q``'s (``fsm`` trimmed: every state
    is live, so a move ``q`` lacks is a word only ``p`` has)."""
    seen, todo = {(p, q)}, [(p, q)]
    while todo:
        a, b = todo.pop()
        if a in fsm.finals and b not in fsm.finals:
            return False
        b_moves = fsm.map.get(b, {})
        for key, a_next in fsm.map.get(a, {}).items():
            if key not in b_moves:
                return False
            pair = (a_next, b_moves[key])
            if pair not in seen:
                seen.add(pair)
                todo.append(pair)
    return True


def _to_first_final(fsm: FSM) -> FSM:
    """``fsm`` stopped at its final states: the words of its language with no proper prefix
    in it."""
    table = {q: ({} if q in fsm.finals else dict(moves)) for q, moves in fsm.map.items()}
    return FSM(alphabet=fsm.alphabet, states=set(fsm.states), initial=fsm.initial, finals=set(fsm.finals), map=table)
