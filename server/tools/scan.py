"""Incremental recognisers for the pieces of a call, shared by the parser and the streamer.

Each works on a growing text buffer and answers PARTIAL (need more text), INVALID (cannot become a
call) or a completed result, so streamed and whole-text parsing take identical decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from server.tools.format import CALL_CLOSE, CALL_OPEN


class Status(Enum):
    PARTIAL = "partial"
    INVALID = "invalid"
    DONE = "done"


_WS = " \t\r\n"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class Header:
    """Result of :func:`scan_header`: status, the called name, and where the arguments begin."""

    status: Status
    name: str = ""
    end: int = 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _expect(text: str, pos: int, literal: str) -> tuple[Status, int]:
    """Match ``literal`` at ``pos`` (after optional whitespace)."""
    pos = _skip_ws(text, pos)
    rest = text[pos : pos + len(literal)]
    if rest == literal:
        return Status.DONE, pos + len(literal)
    return (Status.PARTIAL if literal.startswith(rest) else Status.INVALID), pos


def _scan_name(text: str, pos: int, names: frozenset[str]) -> tuple[Status, str, int]:
    status, pos = _expect(text, pos, '"')
    if status is not Status.DONE:
        return status, "", pos
    start = pos
    while pos < len(text) and text[pos] in _NAME_CHARS and pos - start <= 64:
        pos += 1
    if pos == len(text):
        return Status.PARTIAL, "", pos
    name = text[start:pos]
    if text[pos] != '"' or name not in names:
        return Status.INVALID, "", pos
    return Status.DONE, name, pos + 1


def scan_header(text: str, pos: int, names: frozenset[str]) -> Header:
    """Recognise ``<tool_call>{"name": "<known name>", "arguments": `` at ``pos`` (whitespace
    between tokens tolerated). DONE only once the arguments' opening ``{`` is visible; ``end`` is
    its index."""
    status, pos = _expect(text, pos, CALL_OPEN)
    for literal in ("{", '"name"', ":"):
        if status is not Status.DONE:
            return Header(status)
        status, pos = _expect(text, pos, literal)
    if status is not Status.DONE:
        return Header(status)
    status, name, pos = _scan_name(text, pos, names)
    for literal in (",", '"arguments"', ":", "{"):
        if status is not Status.DONE:
            return Header(status)
        status, pos = _expect(text, pos, literal)
    if status is not Status.DONE:
        return Header(status)
    return Header(Status.DONE, name, pos - 1)


class ObjectScanner:
    """Finds where a JSON object that starts with ``{`` ends, fed text piece by piece.

    Tracks only nesting and strings; the object's validity is checked separately.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """Consume ``text``; return the index just past the closing brace, or -1 if not closed."""
        for i, ch in enumerate(text):
            if self._step(ch):
                self.done = True
                return i + 1
        return -1

    def _step(self, ch: str) -> bool:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def scan_tail(text: str, pos: int) -> tuple[Status, int]:
    """Recognise ``}</tool_call>`` (whitespace tolerated) after the arguments object."""
    status, pos = _expect(text, pos, "}")
    if status is not Status.DONE:
        return status, pos
    return _expect(text, pos, CALL_CLOSE)


def trigger_hold(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for size in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
