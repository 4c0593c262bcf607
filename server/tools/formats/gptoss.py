"""``gpt-oss``: OpenAI harmony messages::

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER

The analysis channel is reasoning, final (and commentary without a recipient, a preamble) is
content, a message with recipient ``functions.NAME`` (in the role or the channel part of the
header) is a call. Format: https://github.com/openai/harmony (``docs/format.md``) and
https://cookbook.openai.com/articles/openai-harmony.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tools.formats.base import Event, OutputParser, ParserOptions, SteppingParser, ToolFormat, _partial_suffix, json_object_end, loads_object

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_TERMINATORS = (END, CALL, RETURN, START, CHANNEL)
_RECIPIENT = re.compile(r"to=(?:functions\.)?([A-Za-z0-9_.\-]+)")


class HarmonyParser(SteppingParser):
    def __init__(self, options: ParserOptions) -> None:
        self.options = options
        self.buf = ""
        self.mode = "header"  # header | body | call
        self.header = ""
        self.kind = "content"
        self.recipient = ""
        self.started = {"content": False, "reasoning": False}
        self.hold = {"content": "", "reasoning": ""}

    def _step(self, out: list[Event], final: bool) -> bool:
        if self.mode == "header":
            return self._header(out, final)
        return self._body(out, final)

    def _header(self, out: list[Event], final: bool) -> bool:
        if self.buf.strip() and not _may_be_header(self.buf):
            self.header, self.kind, self.recipient = "", "content", ""
            self.mode = "body"  # plain text with no header: content
            return True
        pos = self.buf.find(MESSAGE)
        if pos < 0:
            if final and self.buf.strip() and not self.buf.lstrip().startswith((START, CHANNEL)):
                self._emit("content", self.buf, out)
                self.buf = ""
            elif final:
                self.buf = ""
            elif self.buf and not _may_be_header(self.buf):
                self.header, self.kind, self.recipient = "", "content", ""
                self.mode = "body"  # plain text with no header: content
                return True
            return False
        self.header, self.buf = self.buf[:pos], self.buf[pos + len(MESSAGE) :]
        match = _RECIPIENT.search(self.header)
        channel = self.header.split(CHANNEL, 1)[1] if CHANNEL in self.header else ""
        channel = re.split(r"[\s<]", channel.strip(), maxsplit=1)[0] if channel.strip() else ""
        self.recipient = match.group(1) if match else ""
        self.kind = "call" if self.recipient else ("reasoning" if channel == "analysis" else "content")
        self.mode = "call" if self.recipient else "body"
        return True

    def _body(self, out: list[Event], final: bool) -> bool:
        if self.mode == "call" and self.buf.lstrip().startswith("{"):  # markers may sit in strings
            start = len(self.buf) - len(self.buf.lstrip())
            end = json_object_end(self.buf, start)
            if end is None:
                if final:
                    self._close_call(self.buf, out, complete=False)
                    self.buf = ""
                return False
            rest = self.buf[end:]
            stop = next((t for t in (CALL, END, RETURN) if rest.lstrip().startswith(t)), None)
            if stop is None and (rest.strip() or not final) and not any(t.startswith(rest.lstrip()) for t in (CALL, END, RETURN)):
                pass  # not a clean call: fall through to the marker search
            elif stop is None and not final:
                return False
            else:
                self._close_call(self.buf[:end], out, complete=True)
                consumed = len(self.buf) - len(rest.lstrip()) + (len(stop) if stop else 0)
                self.buf = self.buf[consumed:] if stop else ""
                self.mode = "header"
                return True
        hits = self._terminators(final)
        if hits is None:
            return False  # a marker that may or may not end the body: wait for more text
        if not hits:
            if self.mode == "call":
                if final:
                    self._close_call(self.buf, out, complete=True)
                    self.buf = ""
                return False
            keep = 0 if final else _partial_suffix(self.buf, list(_TERMINATORS))
            self._emit(self.kind, self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        pos, marker = min(hits)
        body = self.buf[:pos]
        consumed = pos + (len(marker) if marker in (END, CALL, RETURN) else 0)
        if self.mode == "call":
            self._close_call(body, out, complete=True)
        else:
            self._emit(self.kind, body, out)
        self.buf = self.buf[consumed:]
        self.mode = "header"
        return True

    def _terminators(self, final: bool) -> list[tuple[int, str]] | None:
        """Markers in ``buf`` that end the current body. Inside a message that is not a call,
        ``<|call|>`` (a stop token: nothing follows it) only ends the body when it ends the
        output, and a header marker (``<|start|>``, ``<|channel|>``) only when a header
        (``<|message|>``) follows it before the body could end otherwise: anything else is the
        model writing marker text in its message. None: undecided until more text arrives."""
        hits = [(pos, m) for m in _TERMINATORS if (pos := self.buf.find(m)) >= 0]
        if self.mode != "body":
            return hits
        definite = min((pos for pos, m in hits if m in (END, RETURN)), default=len(self.buf))
        kept = [(pos, m) for pos, m in hits if m in (END, RETURN)]
        for marker in (CALL, START, CHANNEL):
            pos = self.buf.find(marker)
            while 0 <= pos < definite:
                rest = self.buf[pos + len(marker) :]
                if marker == CALL:
                    verdict = not rest.strip() if rest.strip() or final else None
                else:
                    verdict = _opens_header(self.buf[pos:], final)
                if verdict is None:
                    return None
                if verdict:
                    kept.append((pos, marker))
                    break
                pos = self.buf.find(marker, pos + len(marker))
        return kept

    def _close_call(self, body: str, out: list[Event], complete: bool) -> None:
        arguments = loads_object(body.strip())
        if arguments is not None and self.options.allows(self.recipient):
            out.append(Event("call", name=self.recipient, arguments=json.dumps(arguments, ensure_ascii=False)))
        elif body.strip():
            self._emit("content", body, out)

    def _emit(self, kind: str, text: str, out: list[Event]) -> None:
        if not text:
            return
        if not self.started[kind]:
            text = text.lstrip()
            if not text:
                return
        pending = self.hold[kind] + text
        body = pending.rstrip()
        self.hold[kind] = pending[len(body) :]
        if body:
            self.started[kind] = True
            out.append(Event(kind, body))  # type: ignore[arg-type]


def _opens_header(text: str, final: bool) -> bool | None:
    """Whether ``text`` (starting with a header marker) is a message header: ``<|message|>``
    comes before any end marker. None: not known until more text arrives."""
    found = [i for i in (text.find(m) for m in (MESSAGE, END, CALL, RETURN)) if i >= 0]
    if not found:
        return False if final else None
    return min(found) == text.find(MESSAGE)


def _may_be_header(buf: str) -> bool:
    """Whether ``buf`` (no ``<|message|>`` yet) can still be a message header: harmony headers
    start with ``<|start|>``, ``<|channel|>``, a role or a recipient (``to=``) when the generation
    prompt already wrote ``<|start|>assistant``."""
    text = buf.lstrip()
    return any(h.startswith(text) or text.startswith(h) for h in (START, CHANNEL, "to=", "assistant"))


class GptOssFormat(ToolFormat):
    name = "gpt-oss"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
    has_reasoning = True
    trigger = "<|channel|>commentary to=functions."

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return CHANNEL in template and MESSAGE in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return HarmonyParser(options)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
            "content": content,
            "end": CALL,
        }
