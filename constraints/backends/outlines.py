"""outlines-core backend: regex and choice as a token-level DFA (exported as TokenDFA).

Index construction runs in a compile worker process (a regex whose DFA explodes can run for
minutes inside outlines-core); the DFA tables come back as numpy arrays.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import ConstraintTooLargeError, EmptyLanguageError, InvalidConstraintError
from ..spec import ConstraintSpec
from .base import Backend, CompiledConstraint, Matcher, TokenDFA
from .messages import backend_message
from .tokendfa import DFAMatcher, DFATables, build_allowed, dfa_distances, to_token_dfa
from .vocabulary import TokenizerContext, token_bytes, vocabulary_bytes

MAX_DFA_BYTES = 64 << 20  # TokenDFA tables (allowed bitmask dominates) above this -> other backend
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def escape_regex(text: str) -> str:
    """Escape a literal for outlines-core / Rust regex syntax."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choice_regex(choices: list[str] | tuple[str, ...]) -> str:
    """Regex matching exactly one of ``choices``."""
    return "(" + "|".join(escape_regex(c) for c in dict.fromkeys(choices)) + ")"


# outlines-core's DFA has leftmost-first match semantics: once a branch matches, the branches
# after it are dropped, so `a|ab` would never produce "ab". The index is built for the regex
# followed by an end marker instead (no thread matches before the marker), and the states from
# which the marker's bytes reach a match become the final states. The marker is a
# noncharacter, which no answer contains.
END_MARKER = "\U0010ffff"


def end_marker_ids(vocabulary: dict[bytes, list[int]]) -> list[int] | None:
    """One single-byte token per byte of END_MARKER, or None when the vocabulary lacks one."""
    ids = [vocabulary.get(bytes([b])) for b in END_MARKER.encode()]
    return [found[0] for found in ids] if all(ids) else None


def _build_tables(regex: str, vocabulary: Any, stop_ids: tuple[int, ...], marker: list[int] | None) -> DFATables:
    """regex -> DFA tables (numpy)."""
    import outlines_core

    try:
        index = outlines_core.Index(f"(?:{regex})\\U0010ffff" if marker else regex, vocabulary)
    except Exception as exc:
        raise InvalidConstraintError(f"invalid regex: {backend_message(str(exc))[:200]}") from None
    trans = {s: dict(edges) for s, edges in index.get_transitions().items()}
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    if marker:
        finals = _strip_end_marker(trans, finals, marker, initial)
    if not finals:
        raise EmptyLanguageError("the regex matches no string")
    return _tables(trans, finals, initial, stop_ids)


def _strip_end_marker(trans: dict[int, dict[int, int]], marked: set[int], marker: list[int], initial: int) -> set[int]:
    """Final states of the regex without its end marker; ``trans`` loses the marker's states and
    every state that can no longer reach a final one."""
    finals = set()
    for s in set(trans) | {initial}:
        cur: int | None = s
        for t in marker:
            cur = trans.get(cur, {}).get(t) if cur is not None else None
        if cur in marked:
            finals.add(s)
    alive = set(finals)
    preds: dict[int, set[int]] = {}
    for s, edges in trans.items():
        for n in edges.values():
            preds.setdefault(n, set()).add(s)
    todo = list(finals)
    while todo:
        for p in preds.get(todo.pop(), ()):
            if p not in alive:
                alive.add(p)
                todo.append(p)
    for s in list(trans):
        if s not in alive:
            del trans[s]
        else:
            trans[s] = {t: n for t, n in trans[s].items() if n in alive}
    return finals


def _tables(trans: dict[int, dict[int, int]], finals: set[int], initial: int, stop_ids: tuple[int, ...]) -> DFATables:
    import numpy as np

    order = sorted(set(trans) | finals | {initial})
    num = {s: i for i, s in enumerate(order)}
    stops = set(stop_ids)
    offsets, tokens, nexts = [0], [], []
    for s in order:
        edges = sorted((t, num[n]) for t, n in trans.get(s, {}).items() if t not in stops)
        tokens.extend(t for t, _ in edges)
        nexts.extend(n for _, n in edges)
        offsets.append(len(tokens))
    return DFATables(
        initial_state=num[initial],
        offsets=np.asarray(offsets, dtype=np.int32),
        tokens=np.asarray(tokens, dtype=np.int32),
        next=np.asarray(nexts, dtype=np.int32),
        final=np.asarray([s in finals for s in order], dtype=np.bool_),
    )


class OutlinesCompiled(CompiledConstraint):
    def __init__(self, spec: ConstraintSpec, ctx: TokenizerContext, tables: DFATables) -> None:
        self.spec = spec
        self.backend = "outlines"
        self._ctx = ctx
        self._tables = tables
        words = (ctx.vocab_size + 31) // 32
        self._allowed = build_allowed(tables, words, ctx.stop_token_ids)
        self._dfa: TokenDFA | None = None
        self._bytes = tables.nbytes(words)
        self._distances: tuple[Any, Any] | None = None
        self._lock = threading.Lock()

    def new_matcher(self) -> Matcher:
        return DFAMatcher(self._ctx, self._tables, self._allowed, token_bytes(self._ctx), self.distances)

    def distances(self) -> tuple[Any, Any]:
        """Per-state distance to a final state and the next token of a shortest path (built
        on first use: only close_on_length asks)."""
        with self._lock:
            if self._distances is None:
                self._distances = dfa_distances(self._tables)
            return self._distances

    def token_dfa(self) -> TokenDFA:
        if self._dfa is None:
            self._dfa = to_token_dfa(self._tables, self._allowed, self._ctx.stop_token_ids)
        return self._dfa

    def size_bytes(self) -> int:
        return self._bytes


class OutlinesBackend(Backend):
    """regex / choice -> token DFA; the payload is the DFA's tables."""

    name = "outlines"

    def __init__(self, ctx: TokenizerContext) -> None:
        super().__init__(ctx)
        self._vocabulary: Any = None
        self._marker: list[int] | None = None

    def prepare(self) -> None:
        if self._vocabulary is None:
            import outlines_core

            eos = self.ctx.stop_token_ids[0] if self.ctx.stop_token_ids else 0
            vocabulary = vocabulary_bytes(self.ctx)
            self._marker = end_marker_ids(vocabulary)
            self._vocabulary = outlines_core.Vocabulary(eos, vocabulary)

    def compile(self, spec: ConstraintSpec, source: Any) -> DFATables:
        self.prepare()
        regex = choice_regex(source) if spec.kind == "choice" else source
        tables = _build_tables(regex, self._vocabulary, tuple(self.ctx.stop_token_ids), self._marker)
        words = (self.ctx.vocab_size + 31) // 32
        if tables.nbytes(words) > MAX_DFA_BYTES:
            raise ConstraintTooLargeError(
                f"token DFA has {tables.num_states} states, above the size budget"
            )
        return tables

    def load(self, spec: ConstraintSpec, payload: DFATables) -> CompiledConstraint:
        return OutlinesCompiled(spec, self.ctx, payload)
