"""Incremental detokenization and stop-string handling.

Decoding token by token breaks multi-byte characters and loses the spaces that SentencePiece-style
tokenizers attach to the next token, so the text of new tokens is always decoded together with
the previously read tokens as left context and only emitted once it no longer ends in a replacement character.
An output that ends inside a character (cut by ``max_tokens`` or a stop) drops that character's
first bytes rather than showing a replacement character the model never wrote; one it wrote
whole (the bytes of U+FFFD) is kept.

Stops are strings (held back while the text may still be starting one) and regular expressions
(``stop_regex``, Python ``regex`` syntax): text is held back from the start of the earliest partial
match (``regex``'s ``partial=True``), so a regex stop also matches across token boundaries and the
stop text never reaches the client.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

import regex

from constraints.backends.vocabulary import rust_tokenizer

_REPLACEMENT = "\ufffd"
_REGEX_TIMEOUT_S = 0.05  # per search: a catastrophically backtracking stop_regex fails its sequence only
_ADDED_IDS: dict[int, frozenset[int]] = {}
_TOKEN_BYTES: dict[int, list[bytes]] = {}


def fast_decode(tokenizer):
    """``decode(ids, skip_special_tokens)``: the Rust tokenizer's own where transformers' wrapper
    adds nothing to it (a quarter of the time per call, and the detokenizer decodes twice per
    token), else the tokenizer's ``decode``."""
    backend = rust_tokenizer(tokenizer)
    return backend.decode if backend is not None else tokenizer.decode


def added_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's added tokens (special tokens among them), computed once."""
    key = id(tokenizer)
    ids = _ADDED_IDS.get(key)
    if ids is None:
        vocab = getattr(tokenizer, "get_added_vocab", dict)()
        ids = _ADDED_IDS[key] = frozenset(vocab.values()) | frozenset(getattr(tokenizer, "all_special_ids", ()))
    return ids


def ends_inside_character(tokenizer, ids: list[int]) -> bool:
    """The tokens' bytes end with an incomplete UTF-8 sequence (True too when the tokenizer's
    token bytes are unknown: a trailing replacement character at a cut is almost always one)."""
    table = _token_bytes(tokenizer)
    if table is None:
        return True
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(table[i] for i in ids if 0 <= i < len(table)))
    return bool(decoder.getstate()[0])


def _token_bytes(tokenizer) -> list[bytes] | None:
    """Every token's raw bytes (xgrammar's reading of the tokenizer), built on first use."""
    key = id(tokenizer)
    if key not in _TOKEN_BYTES:
        try:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(tokenizer)
            _TOKEN_BYTES[key] = [bytes(b) for b in info.decoded_vocab]
        except Exception:
            _TOKEN_BYTES[key] = None
    return _TOKEN_BYTES[key]


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    tokenizer: object
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._fast_decode = fast_decode(self.tokenizer)

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
        """Text still held back at the end of generation, less a character the output ends
        inside of (its first bytes alone decode to a replacement character)."""
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        self._read_offset = len(self.tokens)
        text = full[len(prefix) :] if len(full) > len(prefix) else ""
        if text.endswith(_REPLACEMENT) and ends_inside_character(self.tokenizer, self.tokens[self._prefix_offset :]):
            text = text[:-1]
        return text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self.spaces_between_special_tokens:
            return self._decode_spaced(ids)
        return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_spaced(self, ids: list[int]) -> str:
        """Added (special) tokens as separate pieces joined to their neighbours by one space
        (fast tokenizers ignore ``spaces_between_special_tokens``, so it is done here)."""
        added = added_token_ids(self.tokenizer)
        special = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        pieces: list[str] = []
        run: list[int] = []
        for token in ids:
            if token not in added:
                run.append(token)
                continue
            if run:
                pieces.append(self.tokenizer.decode(run, skip_special_tokens=self.skip_special_tokens))
                run = []
            if not (self.skip_special_tokens and token in special):
                pieces.append(self.tokenizer.decode([token], skip_special_tokens=False))
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=self.skip_special_tokens))
        return " ".join(piece for piece in pieces if piece)


@dataclass
class StopStringMatcher:
    """Finds stop strings and stop regexes across token boundaries and holds back text that may
    start one. A regex stop reports the text it matched."""

    stops: tuple[str, ...]
    include_stop: bool = False
    regexes: tuple[Any, ...] = ()  # compiled ``regex`` patterns
    text: str = ""
    _emitted: int = 0

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Append ``delta``; return (text safe to emit now, the stop string hit or None)."""
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        hit = self._earliest(self._find_stop(search_from), self._find_regex())
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self.include_stop else index
            self.text = self.text[:end]
            return self._emit_until(len(self.text)), stop
        return self._emit_until(min(len(self.text) - self._holdback, self._regex_holdback())), None

    @staticmethod
    def _earliest(a: tuple[int, str] | None, b: tuple[int, str] | None) -> tuple[int, str] | None:
        if a is None or b is None:
            return a or b
        return a if a[0] <= b[0] else b

    def _find_regex(self) -> tuple[int, str] | None:
        """The earliest complete, non-empty regex match in the text not yet emitted (text before
        it cannot start a match: it was released only once no partial match started there)."""
        best: tuple[int, str] | None = None
        for pattern in self.regexes:
            for match in pattern.finditer(self.text, self._emitted, timeout=_REGEX_TIMEOUT_S):
                if match.end() > match.start():
                    if best is None or match.start() < best[0]:
                        best = (match.start(), match.group(0))
                    break
        return best

    def _regex_holdback(self) -> int:
        """Where the earliest partial regex match (text that may still become a stop) starts."""
        start = len(self.text)
        for pattern in self.regexes:
            for match in pattern.finditer(self.text, self._emitted, partial=True, timeout=_REGEX_TIMEOUT_S):
                if match.partial:
                    start = min(start, match.start())
                    break
        return start

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
