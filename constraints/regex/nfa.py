"""Automata for the regex front end: NFAs built piece by piece, made deterministic in one go.

interegular's FSM algebra builds a DFA after every operation and finds states by a linear
search, which costs seconds on a union of a hundred words. Here a regex becomes one
Thompson NFA (:class:`Nfa`, fragments joined by empty moves) and one subset construction
(:func:`determinize`), indexed by dict and stopped past a state budget (:class:`TooLarge`).
The results are interegular :class:`~interegular.fsm.FSM` objects over one alphabet whose
transition keys never change, so they can be combined state by state (:func:`crawl`) and
written back by :mod:`constraints.regex.complement`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from interegular.fsm import FSM, Alphabet

Fragment = tuple[int, int]  # (entry, exit) states of a piece of an Nfa


class TooLarge(Exception):
    """A construction passed its state budget."""


class Nfa:
    """A nondeterministic automaton under construction: states are numbers, moves are
    (transition key, target) pairs, and empty moves join the fragments."""

    def __init__(self) -> None:
        self.moves: list[list[tuple[int, int]]] = []
        self.empty: list[list[int]] = []

    def state(self) -> int:
        self.moves.append([])
        self.empty.append([])
        return len(self.moves) - 1

    def chars(self, keys: Iterable[int]) -> Fragment:
        """One character with any of the transition ``keys``."""
        entry, exit_ = self.state(), self.state()
        self.moves[entry].extend((key, exit_) for key in keys)
        return entry, exit_

    def chain(self, steps: list[list[int]]) -> Fragment:
        """One character per step, each with any of that step's transition keys (a run of
        characters with no empty move between them)."""
        entry = last = self.state()
        for keys in steps:
            nxt = self.state()
            self.moves[last].extend((key, nxt) for key in keys)
            last = nxt
        return entry, last

    def nothing(self) -> Fragment:
        """The empty string only."""
        entry = self.state()
        return entry, entry

    def concat(self, parts: list[Fragment]) -> Fragment:
        if not parts:
            return self.nothing()
        for (_, left_exit), (right_entry, _) in itertools.pairwise(parts):
            self.empty[left_exit].append(right_entry)
        return parts[0][0], parts[-1][1]

    def union(self, parts: list[Fragment]) -> Fragment:
        entry, exit_ = self.state(), self.state()
        for part_entry, part_exit in parts:
            self.empty[entry].append(part_entry)
            self.empty[part_exit].append(exit_)
        return entry, exit_

    def star(self, part: Fragment) -> Fragment:
        entry, exit_ = self.state(), self.state()
        self.empty[entry] += [part[0], exit_]
        self.empty[part[1]] += [part[0], exit_]
        return entry, exit_

    def optional(self, part: Fragment) -> Fragment:
        return self.union([part, self.nothing()])

    def embed(self, fsm: FSM) -> tuple[Fragment, dict[Any, int]]:
        """A copy of the DFA ``fsm`` (over the same transition keys), and the state of the
        copy for each of its states."""
        number = {state: self.state() for state in fsm.states}
        exit_ = self.state()
        for state, moves in fsm.map.items():
            self.moves[number[state]].extend((key, number[target]) for key, target in moves.items())
        for state in fsm.finals:
            self.empty[number[state]].append(exit_)
        return (number[fsm.initial], exit_), number

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        """The states reached from ``states`` by empty moves."""
        seen, todo = set(states), list(states)
        while todo:
            for target in self.empty[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)


def determinize(nfa: Nfa, part: Fragment, alphabet: Alphabet, limit: int) -> FSM:
    """The DFA of the fragment ``part`` of ``nfa`` (subset construction)."""
    grouped: dict[frozenset[int], dict[int, list[int]]] = {}  # the moves of the subset in hand

    def important(states: frozenset[int]) -> frozenset[int]:
        # states with only empty moves change nothing: subsets that differ in them are one
        return frozenset(s for s in states if nfa.moves[s] or s == part[1])

    def follow(subset: frozenset[int], key: int) -> frozenset[int] | None:
        if subset not in grouped:
            grouped.clear()
            moves = grouped[subset] = {}
            for state in subset:
                for k, target in nfa.moves[state]:
                    moves.setdefault(k, []).append(target)
        targets = grouped[subset].get(key)
        return important(nfa.closure(targets)) if targets else None

    keys = sorted(set(alphabet.values()))
    start = important(nfa.closure([part[0]]))
    return crawl(alphabet, keys, start, follow, lambda subset: part[1] in subset, limit)


def crawl(alphabet: Alphabet, keys: list[int], start: Hashable, follow: Callable[[Any, int], Any],
          final: Callable[[Any], bool], limit: int) -> FSM:
    """The DFA reached from ``start`` by ``follow(state, key)`` (None: no move); TooLarge past
    ``limit`` states."""
    index, states, table = {start: 0}, [start], {}
    for i, state in enumerate(states):  # grows while it is read
        table[i] = {}
        for key in keys:
            nxt = follow(state, key)
            if nxt is None:
                continue
            if nxt not in index:
                index[nxt] = len(states)
                states.append(nxt)
                if len(states) > limit:
                    raise TooLarge
            table[i][key] = index[nxt]
    finals = {i for i, state in enumerate(states) if final(state)}
    return FSM(alphabet=alphabet, states=set(range(len(states))), initial=0, finals=finals, map=table)


def reverse(fsm: FSM, limit: int) -> FSM:
    """The DFA of the reversed words of ``fsm``."""
    nfa = Nfa()
    number = {state: nfa.state() for state in fsm.states}
    entry, exit_ = nfa.state(), nfa.state()
    for state, moves in fsm.map.items():
        for key, target in moves.items():
            nfa.moves[number[target]].append((key, number[state]))
    nfa.empty[entry].extend(number[state] for state in fsm.finals)
    nfa.empty[number[fsm.initial]].append(exit_)
    return determinize(nfa, (entry, exit_), fsm.alphabet, limit)


def minimize(fsm: FSM, limit: int) -> FSM:
    """The minimal DFA of ``fsm``'s language, with no dead state (Moore's partition
    refinement over the live states: states part when their moves lead to different parts)."""
    live = _live(fsm)
    if fsm.initial not in live:
        return FSM(alphabet=fsm.alphabet, states={0}, initial=0, finals=set(), map={0: {}})
    moves = {q: {k: t for k, t in fsm.map.get(q, {}).items() if t in live} for q in live}
    part = {q: int(q in fsm.finals) for q in live}
    while True:
        signature = {q: (part[q], tuple(sorted((k, part[t]) for k, t in moves[q].items()))) for q in live}
        number: dict[tuple, int] = {}
        refined = {q: number.setdefault(signature[q], len(number)) for q in live}
        if len(number) == len(set(part.values())):
            break
        part = refined
    table = {part[q]: {k: part[t] for k, t in moves[q].items()} for q in live}
    return FSM(alphabet=fsm.alphabet, states=set(table), initial=part[fsm.initial],
               finals={part[q] for q in fsm.finals if q in live}, map=table)


def _live(fsm: FSM) -> set[Any]:
    """The states of ``fsm`` from which a final state can be reached."""
    into: dict[Any, list[Any]] = {}
    for q, moves in fsm.map.items():
        for t in moves.values():
            into.setdefault(t, []).append(q)
    live, todo = set(fsm.finals), list(fsm.finals)
    while todo:
        for q in into.get(todo.pop(), ()):
            if q not in live:
                live.add(q)
                todo.append(q)
    return live


def complement(fsm: FSM, keys: list[int], limit: int) -> FSM:
    """The DFA of the words over ``keys`` that ``fsm`` rejects."""
    sink = object()  # where ``fsm`` has no move: every word from there is in the complement

    def follow(state: Any, key: int) -> Any:
        return sink if state is sink else fsm.map.get(state, {}).get(key, sink)

    return crawl(fsm.alphabet, keys, fsm.initial, follow, lambda s: s is sink or s not in fsm.finals, limit)


def same(a: FSM, b: FSM, keys: list[int], limit: int) -> bool:
    """Whether ``a`` and ``b`` (same alphabet) accept the same words over ``keys``."""
    seen, todo = {(a.initial, b.initial)}, [(a.initial, b.initial)]
    while todo:
        p, q = todo.pop()
        if (p in a.finals) != (q in b.finals):
            return False
        for key in keys:
            pair = (a.map.get(p, {}).get(key), b.map.get(q, {}).get(key))
            if pair != (None, None) and pair not in seen:
                if len(seen) > limit:
                    raise TooLarge
                seen.add(pair)
                todo.append(pair)
    return True
