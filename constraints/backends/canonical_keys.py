"""Object keys written one way only: the escapes ``json.dumps(..., ensure_ascii=False)`` writes.

A JSON key may spell a character raw or escaped (``"a"`` and ``"\\u0061"`` are the same key), and
the backends compare keys as written: for ``{"properties": {"a": {"type": "integer"}}}``
llguidance took ``{"\\u0061": "x"}`` as an unlisted key, so a string got past ``a``'s schema.
:class:`CanonicalKeys` wraps a JSON matcher and refuses, inside a key, every escape but those a
key must use: ``\\"``, ``\\\\``, the short forms ``\\b \\f \\n \\r \\t`` and ``\\u00XX`` (lower-case
hex) for the other control characters. Every ASCII character of a key then has exactly one
spelling, the one the backends compare, so a listed name can only be written as itself. A
non-ASCII character may still be escaped (``json.dumps`` writes ``"\\u00e9"``) unless some key
name of the schema holds one or a pattern decides which keys take which schema (a pattern is
matched as written): then it is written raw. String values keep every escape.

The matcher follows the text a byte at a time (containers, keys, strings). Outside an escape
only the few tokens that hold a backslash can write one (their refusals are kept per scanner
state); inside one, every token the backend allows is looked at. Where its
rule would leave the backend nothing (a grammar that forces an escaped spelling), it lets the
backend's choice through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from .base import CompiledConstraint, Matcher
from .narrowing import NarrowingConstraint, NarrowingMatcher
from .vocabulary import TokenizerContext, token_texts

if TYPE_CHECKING:
    import torch

# modes: between tokens, in a key, in a key's escape (after "\\", after "\\u" + digits), in a value string
_OUT, _KEY, _KEY_ESCAPE, _KEY_HEX, _VALUE, _VALUE_ESCAPE = range(6)
_SHORT = frozenset(b'"\\bfnrt')  # the escapes a key may hold besides \u00XX
_SHORT_FORMS = frozenset(b"89acd")  # \u0008 \u0009 \u000a \u000c \u000d: written \b \t \n \f \r
_HEX = frozenset(b"0123456789abcdef")
_ANY_HEX = frozenset(b"0123456789abcdefABCDEF")
_STATES_KEPT = 256  # scanner states whose refused tokens a tokenizer's table keeps
_MOVES_KEPT = 16_384  # (scan, token) moves a tokenizer's table keeps (a few MB)
_UNSEEN = object()


class Scan(NamedTuple):
    """Where the text is: the open containers (``True``: an object), the mode, whether a key
    comes next in the innermost object, and the hex digits of a key's ``\\u`` escape so far."""

    stack: tuple = ()
    mode: int = _OUT
    key_next: bool = False
    hex: bytes = b""


def step(scan: Scan, byte: int, wide: bool = False) -> Scan | None:
    """The scan after ``byte``, or None where the byte makes a key's spelling other than the one
    (``wide``: a non-ASCII character may be escaped)."""
    mode = scan.mode
    if mode == _VALUE:
        return scan._replace(mode=_OUT) if byte == 0x22 else scan._replace(mode=_VALUE_ESCAPE) if byte == 0x5C else scan
    if mode == _VALUE_ESCAPE:
        return scan._replace(mode=_VALUE)
    if mode == _KEY:
        return scan._replace(mode=_OUT) if byte == 0x22 else scan._replace(mode=_KEY_ESCAPE) if byte == 0x5C else scan
    if mode == _KEY_ESCAPE:
        if byte == 0x75:  # u
            return scan._replace(mode=_KEY_HEX, hex=b"")
        return scan._replace(mode=_KEY) if byte in _SHORT else None
    if mode == _KEY_HEX:
        return _hex_step(scan, byte, wide)
    return _structure(scan, byte)


def _hex_step(scan: Scan, byte: int, wide: bool) -> Scan | None:
    """A ``\\u`` escape's next digit: ``\\u0000``-``\\u001f`` in lower case but the five with a
    short form; with ``wide``, also any escape of a code point from U+0080 on."""
    seen = scan.hex
    if seen.startswith(b"+"):  # a non-ASCII code point: any hex digit
        ok = byte in _ANY_HEX
    elif byte in _HEX and _control_prefix(seen + bytes((byte,))):
        ok = True
    else:
        ok = wide and byte in _ANY_HEX and _wide_prefix(seen + bytes((byte,)))
        if ok:
            seen = b"+" + seen
    if not ok:
        return None
    if len(seen.lstrip(b"+")) == 3:
        return scan._replace(mode=_KEY, hex=b"")
    return scan._replace(hex=seen + bytes((byte,)))


def _control_prefix(digits: bytes) -> bool:
    """Whether ``digits`` begin a control character's canonical escape (``001f``, ``000b``)."""
    if digits[:2] != b"00"[: min(len(digits), 2)] or (len(digits) >= 3 and digits[2] not in b"01"):
        return False
    return len(digits) < 4 or not (digits[2] == 0x30 and digits[3] in _SHORT_FORMS)


def _wide_prefix(digits: bytes) -> bool:
    """Whether ``digits`` (any case) can only be a code point from U+0080 on."""
    value = int(digits.decode(), 16) << 4 * (4 - len(digits))
    return value >= 0x80


def _structure(scan: Scan, byte: int) -> Scan:
    """A byte between tokens: containers, commas, colons, the start of a string."""
    if byte == 0x22:
        in_object = bool(scan.stack) and scan.stack[-1]
        return scan._replace(mode=_KEY if in_object and scan.key_next else _VALUE, key_next=False)
    if byte in (0x7B, 0x5B):  # { [
        return Scan(scan.stack + (byte == 0x7B,), _OUT, byte == 0x7B)
    if byte in (0x7D, 0x5D):  # } ]
        return Scan(scan.stack[:-1], _OUT, False)
    if byte == 0x2C:  # ,
        return scan._replace(key_next=bool(scan.stack) and scan.stack[-1])
    return scan  # white space, a colon, numbers and literals


def scan_bytes(scan: Scan, data: bytes, wide: bool = False) -> Scan | None:
    for byte in data:
        scan = step(scan, byte, wide)
        if scan is None:
            return None
    return scan


class EscapeTable:
    """Per tokenizer: each token's bytes, and the tokens that hold a backslash (the only ones
    that can write an escape)."""

    def __init__(self, ctx: TokenizerContext) -> None:
        self.data = token_texts(ctx)
        self.escaping = np.array([i for i, d in enumerate(self.data) if b"\\" in d], dtype=np.int64)
        # (scan, token) -> the scan after it, and scan -> the escaping tokens it refuses, per
        # ``wide``: shared by the matchers of this tokenizer
        self.moves: dict[bool, dict[tuple, Scan | None]] = {False: {}, True: {}}
        self.refused: dict[bool, dict[Scan, np.ndarray]] = {False: {}, True: {}}

    @classmethod
    def of(cls, ctx: TokenizerContext) -> "EscapeTable":
        return ctx.cached("canonical_keys_table", lambda: cls(ctx))


class CanonicalKeys(NarrowingMatcher):
    """A JSON matcher whose object keys have one spelling (see the module docstring)."""

    def __init__(self, inner: Matcher, table: EscapeTable, wide: bool) -> None:
        super().__init__(inner, Scan())
        self.table = table
        self.wide = wide
        self._free_at = -1  # a depth where the rule let the backend's choice through

    def _after(self, scan: Scan, token_id: int) -> Scan | None:
        moves = self.table.moves[self.wide]
        key = (scan, token_id)
        found = moves.get(key, _UNSEEN)
        if found is _UNSEEN:
            if len(moves) >= _MOVES_KEPT:
                moves.clear()
            data = self.table.data[token_id] if 0 <= token_id < len(self.table.data) else b""
            found = moves[key] = scan_bytes(scan, data, self.wide)
        return found

    def _refused_from(self, scan: Scan) -> np.ndarray:
        refused = self.table.refused[self.wide]
        found = refused.get(scan)
        if found is None:
            if len(refused) >= _STATES_KEPT:
                refused.clear()
            found = refused[scan] = np.array(
                [t for t in self.table.escaping.tolist() if self._after(scan, t) is None], dtype=np.int64)
        return found

    def narrow(self, bitmask: "torch.Tensor", row: int) -> None:
        words = bitmask.numpy()[row].view(np.uint32)
        scan = self._states[-1]
        if scan.mode in (_KEY_ESCAPE, _KEY_HEX):  # inside an escape any token may go on with it
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            refused = np.array([t for t in allowed.tolist() if self._after(scan, t) is None], dtype=np.int64)
        else:
            refused = self._refused_from(scan)
        if not len(refused):
            return
        bits = (words[refused >> 5] >> (refused & 31).astype(np.uint32)) & 1
        hit = refused[bits == 1]
        if not len(hit):
            return
        cleared = words.copy()
        np.bitwise_and.at(cleared, hit >> 5, ~(np.uint32(1) << (hit & 31).astype(np.uint32)))
        if cleared.any():
            words[:] = cleared
        else:  # the rule would leave nothing: the grammar forces an escaped key, let it through
            self._free_at = len(self._states)

    def _changed(self) -> None:
        self._free_at = -1

    def _states_for(self, ids: Sequence[int], forced: bool) -> list[Scan]:
        states, scan = [], self._states[-1]
        for i, token_id in enumerate(ids):
            after = self._after(scan, token_id)
            if after is None:
                if not (forced or (i == 0 and self._free_at == len(self._states))):
                    break
                after = _relaxed(scan, self.table.data[token_id] if 0 <= token_id < len(self.table.data) else b"")
            states.append(after)
            scan = after
        return states


def _relaxed(scan: Scan, data: bytes) -> Scan:
    """The scan after ``data`` with the key rule lifted (each escape taken as any escape)."""
    for byte in data:
        if scan.mode == _KEY_ESCAPE:
            scan = scan._replace(mode=_KEY_HEX, hex=b"") if byte == 0x75 else scan._replace(mode=_KEY)
        elif scan.mode == _KEY_HEX:
            scan = scan._replace(mode=_KEY, hex=b"") if len(scan.hex) == 3 else scan._replace(hex=scan.hex + bytes((byte,)))
        else:
            scan = step(scan, byte)
    return scan


class CanonicalKeysConstraint(NarrowingConstraint):
    """A compiled JSON constraint whose matchers write every key one way."""

    def __init__(self, inner: CompiledConstraint, table: EscapeTable, wide: bool) -> None:
        super().__init__(inner)
        self.table = table
        self.wide = wide

    def new_matcher(self) -> Matcher:
        return CanonicalKeys(self.inner.new_matcher(), self.table, self.wide)


# keywords that give a key's name a meaning (an escaped spelling of the name could get past them)
_NAMING = ("properties", "required", "patternProperties", "propertyNames", "dependencies",
           "dependentRequired", "dependentSchemas")


def canonical_keys(spec: Any, compiled: CompiledConstraint, ctx: TokenizerContext) -> CompiledConstraint:
    """``compiled`` with one spelling per key, for a JSON schema whose keywords name keys."""
    key = spec.key()
    if spec.kind != "json_schema" or not any(f'"{name}"' in key for name in _NAMING):
        return compiled
    return CanonicalKeysConstraint(compiled, EscapeTable.of(ctx), wide=_ascii_names(spec.source))


def _ascii_names(schema: Any) -> bool:
    """Whether every key name the schema gives is ASCII and no pattern picks keys (an escaped
    non-ASCII character then spells no name a keyword compares)."""
    for node in _nodes(schema):
        if any(k in node for k in ("patternProperties", "propertyNames")):
            return False
        names = [n for key in ("properties", "required", "dependencies", "dependentRequired", "dependentSchemas")
                 if isinstance(node.get(key), (dict, list)) for n in node[key]]
        if not all(isinstance(n, str) and n.isascii() for n in names):
            return False
    return True


def _nodes(value: Any):
    """Every dict inside a JSON value (a schema's subschemas among them)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
