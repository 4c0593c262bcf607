"""Run-time checks of a JSON answer (:mod:`constraints.schema.runtime_checks`) over a backend's
matcher: distinct items, distinct keys and key counts, at known paths.

:class:`JsonChecks` reads the answer as it is written (a JSON scanner over the tokens' bytes:
where each value sits, the decoded text of strings, the items and keys seen so far in each
checked container, the text of an item compared whole) and narrows the backend's mask: a token is
refused when its bytes would finish an item equal to an earlier item of a unique array (a string
at its closing quote, an object or array at its closing bracket, a number at what follows it), a
key already present in a checked object, a checked object with fewer keys than its minimum, or
start a member past its maximum; also a prefix only repeats can finish (a listed string, a used
literal). The language only narrows: nothing the backend refuses is let through. A state where no
check can fire (no checked container open) costs nothing; otherwise only the few tokens that
could fire are looked at: those closing a string into a repeated value (an index by the text
before their quote), and those holding a quote, brace, comma or backslash, run through the
scanner.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Sequence

import numpy as np

from ..regex.disjoint import match_progress
from ..schema.runtime_checks import JsonCheck, OtherKey, PatternKey
from .base import CompiledConstraint, Matcher
from .narrowing import NarrowingConstraint, NarrowingMatcher
from .vocabulary import TokenizerContext, token_texts

if TYPE_CHECKING:
    import torch

_WHITESPACE = frozenset(b" \t\r\n")
_ESCAPES = {ord("n"): b"\n", ord("t"): b"\t", ord("r"): b"\r", ord("b"): b"\b", ord("f"): b"\f",
            ord("/"): b"/", ord("\\"): b"\\", ord('"'): b'"'}
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STRUCTURAL_END = frozenset(b",}]")

_VALUE_STATES_KEPT = 16  # string-value states whose refusals a matcher keeps
# scanner modes: between tokens of JSON syntax, in a key, in a string value, in a number/literal
_SYNTAX, _KEY, _STRING, _BARE = 0, 1, 2, 3


class _Refused(Exception):
    pass


def _next_special(data: bytes, start: int) -> int:
    """The position of the next quote or backslash in ``data`` from ``start`` (or its end)."""
    quote, backslash = data.find(b'"', start), data.find(b"\\", start)
    found = [p for p in (quote, backslash) if p >= 0]
    return min(found) if found else len(data)


class Frame(NamedTuple):
    """An open object or array: its path, its check (None: nothing checked), what it holds so
    far (keys of a checked object, items of a unique array), the current key, and whether a key
    comes next."""

    is_object: bool
    path: tuple
    check: JsonCheck | None
    seen: frozenset = frozenset()
    key: str | None = None
    expect_key: bool = False


class ScanState(NamedTuple):
    frames: tuple = ()
    mode: int = _SYNTAX
    text: bytes = b""  # the decoded bytes of the string in progress
    escape: str = ""  # "", "\\", or "u" and the hex digits read
    high: int = 0  # a pending UTF-16 high surrogate
    capture: int = -1  # the array frame whose current item is kept whole (-1: none)
    raw: bytes = b""  # that item's text so far
    escaped: bool = False  # the key in progress holds an escape


@dataclass(frozen=True)
class CheckedPayload:
    """A backend's compiled payload with the checks its matchers run (what the disk cache keeps)."""

    payload: Any
    checks: tuple[JsonCheck, ...]


class Scanner:
    """Steps a :class:`ScanState` over bytes, raising :class:`_Refused` where a check fails."""

    def __init__(self, checks: Sequence[JsonCheck]) -> None:
        self.checks = {c.path: c for c in checks}
        # every path with a check strictly below it
        self._above = {c.path[:n] for c in checks for n in range(len(c.path))}
        # objects whose unlisted keys lead to a check: the names they list
        self._others = {c.path[:n]: step.listed for c in checks for n, step in enumerate(c.path)
                        if isinstance(step, OtherKey)}
        # objects whose unlisted keys all match one pattern leading to a check: that step
        self._patterned = {c.path[:n]: step for c in checks for n, step in enumerate(c.path)
                           if isinstance(step, PatternKey)}

    def plain_keys(self, frame: Frame) -> bool:
        """Whether ``frame``'s keys must be written without escapes: a closed order-free object
        (the backend takes its listed keys as exact-name patterns), or one whose unlisted keys
        lead to a check through a pattern (the backends match a pattern against the key as
        written, where the checks read the key it spells). An open order-free object takes an
        escaped key that spells no listed one."""
        return frame.is_object and ((frame.check is not None and frame.check.closed)
                                    or frame.path in self._patterned)

    def has_below(self, path: tuple) -> bool:
        """Whether a checked container may open inside the value at ``path``."""
        return path in self._above

    def feed(self, state: ScanState, data: bytes) -> ScanState:
        i, end = 0, len(data)
        while i < end:
            if (state.mode == _KEY or state.mode == _STRING) and not state.escape and not state.high:
                stop = _next_special(data, i)
                if stop > i:  # a run of plain string bytes, taken at once
                    raw = state.raw + data[i:stop] if state.capture >= 0 else b""
                    state = state._replace(text=state.text + data[i:stop], raw=raw)
                    i = stop
                    continue
            if state.capture >= 0:
                state = state._replace(raw=state.raw + data[i:i + 1])
            state = self._byte(state, data[i])
            i += 1
        return state

    def _byte(self, state: ScanState, byte: int) -> ScanState:
        mode = state.mode
        if mode == _KEY or mode == _STRING:
            return self._in_string(state, byte)
        if mode == _BARE:
            if byte not in _WHITESPACE and byte not in _STRUCTURAL_END:
                return state
            state = state._replace(mode=_SYNTAX)
            if state.capture >= 0 and state.capture == len(state.frames) - 1:  # a number/literal item ended
                state = _end_item(state, state.raw[:-1])
            if byte in _WHITESPACE:
                return state
        return self._syntax(state, byte)

    def _syntax(self, state: ScanState, byte: int) -> ScanState:
        frames = state.frames
        top = frames[-1] if frames else None
        if byte in _WHITESPACE or byte == ord(":"):
            return state
        if byte == _QUOTE:
            if top is not None and top.is_object and top.expect_key:
                check = top.check
                if check is not None and check.max_properties is not None and len(top.seen) >= check.max_properties:
                    raise _Refused  # a member past the maximum
                if check is not None and _no_key_left(top):
                    raise _Refused
                return state._replace(mode=_KEY, text=b"", escaped=False)
            return _begin_item(state, byte)._replace(mode=_STRING, text=b"")
        if byte == ord("{") or byte == ord("["):
            path = self._child_path(frames)
            is_object = byte == ord("{")
            frame = Frame(is_object, path, self._check_for(path, is_object), expect_key=is_object)
            return _begin_item(state, byte)._replace(frames=frames + (frame,))
        if byte == ord("}") or byte == ord("]"):
            if top is not None and top.is_object and top.check is not None and _unmet(top):
                raise _Refused  # too few keys, or a required one missing
            state = state._replace(frames=frames[:-1])
            if state.capture >= 0 and state.capture == len(frames) - 2:  # a container item closed
                return _end_item(state, state.raw)
            return state
        if byte == ord(","):
            if top is not None and top.is_object:
                check = top.check
                if check is not None and check.max_properties is not None and len(top.seen) >= check.max_properties:
                    raise _Refused
                if check is not None and _no_key_left(top):
                    raise _Refused  # every key the object takes is written already
                return state._replace(frames=frames[:-1] + (top._replace(expect_key=True),))
            if top is not None and top.check is not None and _exhausted(top):
                raise _Refused  # every listed item is written already
            return state
        return _begin_item(state, byte)._replace(mode=_BARE)

    def _check_for(self, path: tuple, is_object: bool) -> JsonCheck | None:
        check = self.checks.get(path)
        if check is None:
            return None
        if is_object:
            return check if check.on_object else None
        return check if check.unique_items else None

    def _child_path(self, frames: tuple) -> tuple:
        if not frames:
            return ()
        top = frames[-1]
        if not top.is_object:
            return (*top.path, None)
        patterned = self._patterned.get(top.path)
        if patterned is not None and top.key not in patterned.listed:
            return (*top.path, patterned)
        listed = self._others.get(top.path)
        return (*top.path, OtherKey(listed) if listed is not None and top.key not in listed else top.key)

    def _in_string(self, state: ScanState, byte: int) -> ScanState:
        escape = state.escape
        if escape == "":
            if byte == _BACKSLASH:
                if state.mode == _KEY and self.plain_keys(state.frames[-1]):
                    raise _Refused  # an escape the backend may not read as the key it spells
                return state._replace(escape="\\", escaped=state.mode == _KEY or state.escaped)
            if byte == _QUOTE:
                return self._close_string(state)
            return state._replace(text=state.text + bytes((byte,)))
        if escape == "\\":
            if byte == ord("u"):
                return state._replace(escape="u")
            return self._append(state._replace(escape=""), _ESCAPES.get(byte, bytes((byte,))))
        digits = escape[1:] + chr(byte)
        if len(digits) < 4:
            return state._replace(escape="u" + digits)
        try:
            code = int(digits, 16)
        except ValueError:
            code = 0xFFFD
        state = state._replace(escape="")
        if 0xD800 <= code < 0xDC00:
            return state._replace(high=code)
        if 0xDC00 <= code < 0xE000 and state.high:
            code = 0x10000 + ((state.high - 0xD800) << 10) + (code - 0xDC00)
            state = state._replace(high=0)
        return self._append(state, chr(code).encode("utf-8", "surrogatepass"))

    @staticmethod
    def _append(state: ScanState, data: bytes) -> ScanState:
        if state.high:  # a lone high surrogate stays as one
            data = chr(state.high).encode("utf-8", "surrogatepass") + data
            state = state._replace(high=0)
        return state._replace(text=state.text + data)

    def _close_string(self, state: ScanState) -> ScanState:
        if state.high:
            state = self._append(state, b"")
        frames, text = state.frames, state.text
        top = frames[-1] if frames else None
        if state.mode == _KEY:
            key = text.decode("utf-8", "surrogatepass")
            seen = top.seen
            if top.check is not None:
                if key in seen:
                    raise _Refused  # a repeated key
                presence = top.check.presence
                if presence is not None and not presence.admits(seen, key):
                    raise _Refused  # no key set the object may hold has it beside those written
                if state.escaped and top.check.free_keys is not None and key in top.check.free_keys:
                    raise _Refused  # a listed key spelled with escapes: the backend reads another key
                seen = seen | {key}
            top = top._replace(seen=seen, key=key, expect_key=False)
            return state._replace(frames=frames[:-1] + (top,), mode=_SYNTAX, text=b"", escape="", high=0)
        state = state._replace(mode=_SYNTAX, text=b"", escape="", high=0)
        if state.capture >= 0 and state.capture == len(frames) - 1:  # a string item of a whole-value array
            return _end_item(state, state.raw)
        if top is not None and not top.is_object and top.check is not None:
            if text in top.seen:
                raise _Refused  # a repeated item
            frames = frames[:-1] + (top._replace(seen=top.seen | {text}),)
        return state._replace(frames=frames)


def _string_items(frame: Frame) -> Iterator[bytes]:
    """The UTF-8 text of the string items a unique array holds so far."""
    for value in frame.seen:
        if isinstance(value, bytes):
            yield value
        elif isinstance(value, str):
            yield value.encode("utf-8", "surrogatepass")
        elif isinstance(value, tuple) and value[0] == "str":
            yield value[1].encode("utf-8", "surrogatepass")


def _captures(frame: Frame | None) -> bool:
    """Whether ``frame`` is a unique array whose items are compared whole (objects, any value)."""
    return frame is not None and not frame.is_object and frame.check is not None and (
        frame.check.object_items or frame.check.any_values)


def _begin_item(state: ScanState, byte: int) -> ScanState:
    """A value starts with ``byte``: when it is an item compared whole, its text is kept."""
    frames = state.frames
    if state.capture < 0 and frames and _captures(frames[-1]):
        return state._replace(capture=len(frames) - 1, raw=bytes((byte,)))
    return state


def _end_item(state: ScanState, text: bytes) -> ScanState:
    """The item kept whole is ``text``: refused when it equals an earlier item of its array."""
    frames, at = state.frames, state.capture
    state = state._replace(capture=-1, raw=b"")
    try:
        value = _canonical(json.loads(text, parse_float=Decimal, parse_int=Decimal))
    except (ValueError, RecursionError):  # not JSON after all: the backend decides
        return state
    array = frames[at]
    if value in array.seen:
        raise _Refused  # a repeated item
    return state._replace(frames=frames[:at] + (array._replace(seen=array.seen | {value}),) + frames[at + 1:])


def _canonical(value: Any) -> Any:
    """A hashable form equal for equal JSON values (JSON Schema's equality: numbers by value,
    object members in any order, true distinct from 1)."""
    if isinstance(value, dict):
        return ("object", frozenset((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, Decimal):
        return ("number", value)
    return (type(value).__name__, value)


# each literal's text and its canonical value
_LITERALS = {b"true": _canonical(True), b"false": _canonical(False), b"null": _canonical(None)}


def _unmet(frame: Frame) -> bool:
    """Whether the checked object ``frame`` may not close yet (too few keys, a required one
    missing)."""
    check, seen = frame.check, frame.seen
    return len(seen) < check.min_properties or any(k not in seen for k in check.required) or any(
        name in seen and any(k not in seen for k in needed) for name, needed in check.dependent_required) or (
        check.presence is not None and not check.presence.complete(seen))


def _no_key_left(frame: Frame) -> bool:
    """Whether the checked object ``frame`` takes only its listed keys and holds all of them
    (or all it may still hold)."""
    check, seen = frame.check, frame.seen
    if not check.closed or check.key_patterns:
        return False
    if check.presence is None:
        return len(seen) >= len(check.free_keys)
    refused = set(check.presence.refused(seen))
    return all(k in seen or k in refused for k in check.free_keys)


def _refused_keys(frame: Frame) -> Iterator[bytes]:
    """The UTF-8 text of the keys a checked object refuses next: those it holds, and those no
    key set it may hold has beside them."""
    yield from _string_items(frame)
    presence = frame.check.presence if frame.check is not None else None
    if presence is not None:
        for key in presence.refused(frame.seen):
            yield key.encode("utf-8", "surrogatepass")


def _progress(pattern: str, text: bytes) -> str:
    """How far a key starting with ``text`` (UTF-8, perhaps cut inside a character) is from
    matching ``pattern`` (:func:`constraints.regex.disjoint.match_progress`)."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        return "live"  # mid-character: decided once the character is whole
    return match_progress(pattern, decoded) or "live"


def _key_settled(state: ScanState) -> bool:
    """Whether the key in progress can match one of its closed object's patterns however it
    goes on (no token can leave it at a dead end)."""
    return any(_progress(p, state.text) == "safe" for p in state.frames[-1].check.key_patterns)


def _exhausted(frame: Frame) -> bool:
    values = frame.check.item_values
    return values is not None and len(frame.seen) >= len(values)


def _dead_end(state: ScanState) -> bool:
    """Whether the item in progress can only be completed into a repeat: a listed string, or a
    literal (``t`` can only be ``true``) in an array of whole items."""
    if state.mode == _BARE and state.capture >= 0 and state.capture == len(state.frames) - 1:
        raw = state.raw
        options = [value for lit, value in _LITERALS.items() if lit.startswith(raw)]
        seen = state.frames[-1].seen
        return bool(options) and all(value in seen for value in options)
    if state.mode not in (_STRING, _KEY) or state.escape or state.high or not state.frames:
        return False
    top = state.frames[-1]
    if state.mode == _KEY:  # a key of an object that takes only listed ones, all of them used
        if not top.is_object or top.check is None or not top.check.closed:
            return False
        text = state.text
        presence = top.check.presence
        refused = set(presence.refused(top.seen)) if presence is not None else ()
        return not any(b.startswith(text) and k not in top.seen and k not in refused
                       for b, k in _encoded_keys(top.check)) and all(
            _progress(p, text) == "dead" for p in top.check.key_patterns)
    if top.is_object or top.check is None or top.check.item_values is None:
        return False
    text = state.text
    return not any(v.startswith(text) and v not in top.seen for v in _encoded(top.check))


@functools.lru_cache(maxsize=256)
def _encoded(check: JsonCheck) -> tuple[bytes, ...]:
    return tuple(v.encode("utf-8", "surrogatepass") for v in check.item_values or ())


@functools.lru_cache(maxsize=256)
def _encoded_keys(check: JsonCheck) -> tuple[tuple[bytes, str], ...]:
    return tuple((k.encode("utf-8", "surrogatepass"), k) for k in check.free_keys or ())


class Kinds(NamedTuple):
    """What a scanner state can refuse, which decides the tokens worth running through it."""

    in_string: bool
    below: bool  # a checked container may open or close below
    low: bool  # an object's minimum of keys, required or dependent keys unmet
    high: bool  # a maximum of keys reached, or every key of a closed object written
    key_next: bool
    listed: bool  # listed items, or a closed object's keys
    capturing: bool  # inside an item compared whole that could repeat one
    item_start: bool  # a literal or a whole item may start
    repeat: bool  # a string that could repeat a key or an item
    plain_keys: bool  # a key written without escapes may start or go on


class TokenTable:
    """Per tokenizer: each token's bytes and the token lists the checks look at."""

    def __init__(self, ctx: TokenizerContext) -> None:
        self.data = token_texts(ctx)
        quotes = np.array([d.count(b'"') for d in self.data])
        has = {c: np.array([c in d for d in self.data]) for c in (b"\\", b"}", b",", b"{", b"[", b"]")}
        ids = np.arange(ctx.vocab_size)
        self.quote_and_brace = ids[(quotes > 0) & has[b"}"]]
        self.quote_and_comma = ids[(quotes > 0) & has[b","]]
        self.quote_and_bracket = ids[(quotes > 0) & has[b"]"]]
        self.with_bracket = ids[has[b"]"]]
        # tokens that begin or finish a literal (``t``, `` true``, ``null``, ...)
        self.literal_starts = ids[[any(lit.startswith(d.lstrip()[:4]) or d.lstrip().startswith(lit)
                                       for lit in _LITERALS) and bool(d.strip()) for d in self.data]]
        self.with_quote = ids[quotes > 0]
        self.with_brace = ids[has[b"}"]]
        self.with_comma = ids[has[b","]]
        self.with_backslash = ids[has[b"\\"]]
        self.many_quotes = ids[quotes > 1]
        # tokens whose closing of a string the index below cannot tell: escapes before the quote
        self.complex_quote = ids[(quotes > 0) & (has[b"\\"] | (quotes > 1))]
        # tokens that open a container and may finish something in it (``{}``, ``["a"``, ``[],``)
        finishing = has[b"}"] | has[b"]"] | has[b","] | (quotes > 1)
        self.opening = ids[(has[b"{"] | has[b"["]) & finishing]
        self.opening_quoted = ids[(has[b"{"] | has[b"["]) & finishing & (quotes > 0)]
        # tokens that close a string with the text before their one quote (no escape in it)
        self.closing: dict[bytes, list[int]] = {}
        for i in ids[(quotes == 1) & ~has[b"\\"]].tolist():
            self.closing.setdefault(self.data[i].split(b'"', 1)[0], []).append(i)

        self._candidates: dict[tuple, np.ndarray] = {}

    def candidates(self, kinds: "Kinds") -> np.ndarray:
        """The tokens to run through the scanner in a state of these ``kinds``, sorted; one
        array per combination, made once."""
        found = self._candidates.get(kinds)
        if found is None:
            in_string, below, low, high, key_next, listed, capturing, item_start, repeat, plain_keys = kinds
            parts = [self.many_quotes]
            if below:
                parts.append(self.opening_quoted if in_string else self.opening)
            if low or capturing:
                parts.append(self.quote_and_brace if in_string else self.with_brace)
            if capturing:
                parts.append(self.quote_and_bracket if in_string else self.with_bracket)
            if item_start:
                parts += [self.literal_starts, self.with_comma, self.with_bracket]
            if high:
                parts.append(self.quote_and_comma if in_string else self.with_comma)
                if key_next and not in_string:
                    parts.append(self.with_quote)
            if listed:  # listed items or a closed object's keys: what starts one
                parts.append(self.quote_and_comma if in_string else self.with_comma)
                if key_next and not in_string:
                    parts.append(self.with_quote)
            if repeat:
                parts.append(self.complex_quote)
            if plain_keys:
                parts.append(self.with_backslash)
            found = self._candidates[kinds] = np.unique(np.concatenate(parts))
        return found

    @classmethod
    def of(cls, ctx: TokenizerContext) -> "TokenTable":
        """The table of ``ctx``'s tokenizer (built once, kept in its cache)."""
        return ctx.cached("json_checks_table", lambda: cls(ctx))


class JsonChecks(NarrowingMatcher):
    """A JSON matcher with run-time checks (see the module docstring)."""

    def __init__(self, inner: Matcher, checks: Sequence[JsonCheck], table: TokenTable) -> None:
        super().__init__(inner, ScanState())
        self.table = table
        self.scanner = Scanner(checks)
        # per open containers (a string value in progress): tokens looked at, tokens refused
        self._after_value: dict[tuple, tuple[np.ndarray, set[int]]] = {}

    # -- the checks ----------------------------------------------------------------------------

    def _after(self, state: ScanState, token_id: int) -> ScanState | None:
        data = self.table.data[token_id] if 0 <= token_id < len(self.table.data) else b""
        try:
            after = self.scanner.feed(state, data)
        except _Refused:
            return None
        return None if data and _dead_end(after) else after

    def _refused_in(self, words: np.ndarray) -> list[int]:
        """Tokens allowed in ``words`` that a check refuses from the current state."""
        state = self._states[-1]
        table, refused = self.table, []
        top = state.frames[-1] if state.frames else None
        if not any(f.check is not None for f in state.frames) and not (
                state.mode in (_SYNTAX, _KEY) and top is not None and self.scanner.plain_keys(top)):
            return [t for t in _allowed(words, table.opening).tolist() if self._after(state, t) is None]
        in_string = state.mode in (_KEY, _STRING)
        counted = [f for f in state.frames if f.is_object and f.check is not None]
        listed = not top.is_object and top.check is not None and top.check.item_values is not None
        closed = top.is_object and top.check is not None and top.check.closed  # only listed keys, once each
        whole = _captures(top)  # at (or in a string or number of) an item compared whole
        mid_escape = in_string and bool(state.escape or state.high)
        if (in_string and listed and state.mode == _STRING) or (whole and state.mode == _BARE) or (
                closed and state.mode == _KEY and not _key_settled(state)):
            # in a listed item, a number or a closed object's key: the few allowed
            ids = np.flatnonzero(_bits(words))
        elif mid_escape or (state.mode == _KEY and state.escaped):
            # what the escape stands for is not known yet, or a key holds one (it may spell a
            # listed key): a token can only refuse by closing the string after it
            ids = _allowed(words, table.with_quote)
        else:
            kinds = Kinds(
                in_string,
                # a token may close containers before it opens one: any check below the root
                # counts, and an item opened and closed in one token (`` {},``)
                self.scanner.has_below(()) or whole,
                any(_unmet(f) for f in counted),
                # a maximum reached or every key written: a comma (perhaps after closing inner
                # containers) is refused
                any((f.check.max_properties is not None and len(f.seen) >= f.check.max_properties)
                    or _no_key_left(f) for f in counted),
                top.is_object and top.expect_key,
                listed or closed,
                # inside an item compared whole, which could repeat one: what closes it
                state.capture >= 0 and not whole and bool(state.frames[state.capture].seen),
                whole and state.mode == _SYNTAX,  # a literal or a whole item may start
                in_string and top.check is not None and (state.mode == _KEY) == top.is_object,
                # a key of an object whose keys are written without escapes may start or go on
                state.mode in (_SYNTAX, _KEY) and self.scanner.plain_keys(top),
            )
            ids = _allowed(words, table.candidates(kinds))
            if kinds.repeat:  # closing into a repeat: the index by the text before the quote
                text = state.text
                for value in (_refused_keys(top) if top.is_object else _string_items(top)):
                    if value.startswith(text):
                        refused.extend(table.closing.get(value[len(text):], ()))
        if state.mode == _STRING and state.capture < 0 and (top.is_object or top.check is None):
            refused.extend(self._refused_after_value(state, ids))
        else:
            refused.extend(t for t in ids.tolist() if self._after(state, t) is None)
        return refused

    def _refused_after_value(self, state: ScanState, ids: np.ndarray) -> list[int]:
        """The tokens among ``ids`` a check refuses in a plain string value: only what follows
        its closing quote can fire, so the answer depends on the open containers (and an
        escape in progress) alone and is kept per such state (a value's tokens are looked at
        once, not at every step)."""
        key = (state.frames, state.escape, state.high)
        entry = self._after_value.get(key)
        if entry is None:
            if len(self._after_value) >= _VALUE_STATES_KEPT:
                self._after_value.pop(next(iter(self._after_value)))
            entry = self._after_value[key] = (np.zeros(len(self.table.data), dtype=bool), set())
        looked, refused = entry
        fresh = ids[~looked[ids]]
        refused.update(t for t in fresh.tolist() if self._after(state, t) is None)
        looked[fresh] = True
        return [t for t in ids.tolist() if t in refused] if refused else []

    def narrow(self, bitmask: "torch.Tensor", row: int) -> None:
        """Clear from ``bitmask[row]`` (the backend's mask of this state) what the checks refuse."""
        words = bitmask.numpy()[row].view(np.uint32)
        for token_id in self._refused_in(words):
            words[token_id >> 5] &= np.uint32(~(1 << (token_id & 31)) & 0xFFFFFFFF)

    def _states_for(self, ids: Sequence[int], forced: bool) -> list[ScanState]:
        """The scanner's states after each token of the longest prefix of ``ids`` the checks take
        (a check is never relaxed: forced text that breaks one is cut there)."""
        states, state = [], self._states[-1]
        for token_id in ids:
            state = self._after(state, token_id)
            if state is None:
                break
            states.append(state)
        return states


def _allowed(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The ids among ``ids`` whose bit is set in ``words``."""
    return ids[(words[ids >> 5] >> (ids & 31)) & 1 == 1] if len(ids) else ids


def _bits(words: np.ndarray) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)


class JsonChecksConstraint(NarrowingConstraint):
    """A compiled JSON constraint whose matchers run :class:`JsonChecks`."""

    def __init__(self, inner: CompiledConstraint, checks: tuple[JsonCheck, ...], table: TokenTable) -> None:
        super().__init__(inner)
        self.checks = checks
        self.table = table

    def new_matcher(self) -> Matcher:
        return JsonChecks(self.inner.new_matcher(), self.checks, self.table)


def with_checks(compiled: CompiledConstraint, checks: tuple[JsonCheck, ...], ctx: TokenizerContext) -> CompiledConstraint:
    """``compiled`` with ``checks`` run on its matchers (itself when there are none)."""
    if not checks:
        return compiled
    return JsonChecksConstraint(compiled, checks, TokenTable.of(ctx))
