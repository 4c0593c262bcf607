"""Incremental detokenization and stop-string handling.

Decoding token by token breaks multi-byte characters and loses the spaces that SentencePiece-style
tokenizers attach to the next token, so the text of new tokens is always decoded together with
the previously read tokens as left context and only emitted once it no longer ends in a replacement character.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    tokenizer: object
    skip_special_tokens: bool = True
    tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def push(self, token_ids: list[int]) -> str:
        """Add tokens and return the newly completed text (possibly empty)."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.tokens)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. a dangling partial character)."""
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        self._read_offset = len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@dataclass
class StopStringMatcher:
    """Finds stop strings across token boundaries and holds back text that may start one."""

    stops: tuple[str, ...]
    include_stop: bool = False
    text: str = ""
    _emitted: int = 0

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Append ``delta``; return (text safe to emit now, the stop string hit or None)."""
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        hit = self._find_stop(search_from)
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self.include_stop else index
            self.text = self.text[:end]
            return self._emit_until(len(self.text)), stop
        return self._emit_until(len(self.text) - self._holdback), None

    def flush(self) -> str:
        return self._emit_until(len(self.text))

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = self.text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _emit_until(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
