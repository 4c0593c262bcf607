"""``kimi``: Kimi K2 / K2.5 / K2.6 calls::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

reasoning in ``<think>...</think>``. Format: Kimi-K2's tool-call guide
(https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/docs/tool_call_guidance.md).

Kimi K3 writes nested elements instead (``<|open|>TAG attrs<|sep|> ... <|close|>TAG<|sep|>``):
``think`` (reasoning), ``response`` (content) and ``tools`` holding
``<|open|>call tool="N" index="i"<|sep|>`` with typed ``<|open|>argument key="K" type="T"<|sep|>V``
elements (Kimi-K3's chat template, https://huggingface.co/moonshotai/Kimi-K3). The variant follows
from the generation prompt (K3's opens ``<|open|>message``).
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from server.tools.formats.base import (
    BlockParser,
    Event,
    OutputParser,
    SteppingParser,
    ParserOptions,
    ToolFormat,
    _Channel,
    _partial_suffix,
    json_object_end,
    loads_object,
)

SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_OPEN, ARG_OPEN, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID_RE = re.compile(r"^\s*(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::\d+)?\s*$")


class KimiParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    calls_end_reasoning = True
    openers = (SECTION_OPEN,)
    strip_content = False
    strip_reasoning = False

    def block_end(self, buf: str, final: bool) -> int | None:
        pos = len(SECTION_OPEN)
        while True:
            arg = buf.find(ARG_OPEN, pos)
            close = buf.find(SECTION_CLOSE, pos)
            if close >= 0 and (arg < 0 or close < arg):
                return close + len(SECTION_CLOSE)
            if arg < 0:
                return None
            start = arg + len(ARG_OPEN)
            while start < len(buf) and buf[start] in " \t\r\n":
                start += 1
            if start == len(buf):
                return None
            end = json_object_end(buf, start) if buf[start] == "{" else start
            if end is None:
                return None
            pos = end

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block[len(SECTION_OPEN) : -len(SECTION_CLOSE)]
        calls = []
        pos = body.find(CALL_OPEN)
        while pos >= 0:
            arg = body.find(ARG_OPEN, pos)
            if arg < 0:
                return None
            match = _ID_RE.match(body[pos + len(CALL_OPEN) : arg])
            start = arg + len(ARG_OPEN)
            while start < len(body) and body[start] in " \t\r\n":
                start += 1
            end = json_object_end(body, start) if start < len(body) and body[start] == "{" else None
            arguments = loads_object(body[start:end]) if end else None
            if match is None or arguments is None or not body[end:].lstrip().startswith(CALL_CLOSE):
                return None
            calls.append((match.group(1), json.dumps(arguments, ensure_ascii=False)))
            pos = body.find(CALL_OPEN, end)
        return calls


OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
# An element closes at the closing marker after which the structure goes on (the next sibling or
# the parent's end): marker text the model writes inside a value is then part of the value, the
# only reading under which the output is well-formed.
_K3_CALL = re.compile(
    r'<\|open\|>call\s+tool="([^"]*)"[^<]*?<\|sep\|>(.*?)<\|close\|>call<\|sep\|>(?=\s*(?:<\|open\|>call\b|\Z))', re.S
)
_K3_ARG = re.compile(
    r'<\|open\|>argument\s+key="([^"]*)"(?:\s+type="([^"]*)")?\s*<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>'
    r'(?=\s*(?:<\|open\|>argument\b|\Z))',
    re.S,
)
_K3_TOOLS_END = CLOSE + "tools" + SEP


class KimiK3Parser(SteppingParser):
    """Kimi K3's nested elements: text goes to the open ``think``/``response`` element's channel,
    a ``tools`` element is collected whole and read as calls."""

    def __init__(self, options: ParserOptions) -> None:
        self.options = options
        self.buf = ""
        self.channel = "reasoning" if options.in_reasoning else "content"
        self.in_tools = False
        self.out = {"content": _Channel("content", False), "reasoning": _Channel("reasoning", False)}

    def _flush(self, out: list[Event]) -> None:
        if self.in_tools:  # cut short: keep the complete calls only
            out += self._calls(self.buf)
        elif self.buf:
            self._text(self.buf, out)
        self.buf = ""

    def _step(self, out: list[Event], final: bool) -> bool:
        if self.in_tools:
            end = self.buf.find(_K3_TOOLS_END)
            if end < 0:
                return False
            out += self._calls(self.buf[:end])
            self.buf, self.in_tools, self.channel = self.buf[end + len(_K3_TOOLS_END) :], False, ""
            return True
        hits = [i for i in (self.buf.find(OPEN), self.buf.find(CLOSE)) if i >= 0]
        if not hits:
            keep = 0 if final else _partial_suffix(self.buf, [OPEN, CLOSE])
            self._text(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        pos = min(hits)
        sep = self.buf.find(SEP, pos)
        if sep < 0:
            self._text(self.buf[:pos], out)
            self.buf = self.buf[pos:]
            return False
        self._text(self.buf[:pos], out)
        opening = self.buf.startswith(OPEN, pos)
        tag = self.buf[pos + len(OPEN if opening else CLOSE) : sep].split(None, 1)
        name = tag[0] if tag else ""
        self.buf = self.buf[sep + len(SEP) :]
        if opening:
            self.channel = {"think": "reasoning", "response": "content"}.get(name, "")
            self.in_tools = name == "tools"
        else:
            self.channel = ""
        return True

    def _text(self, text: str, out: list[Event]) -> None:
        if text:
            self.out[self.channel or "content"].emit(text, out)

    def _calls(self, block: str) -> list[Event]:
        events = []
        for call in _K3_CALL.finditer(block):
            name = html.unescape(call.group(1))
            arguments: dict[str, Any] = {}
            for arg in _K3_ARG.finditer(call.group(2)):
                key, kind, raw = html.unescape(arg.group(1)), arg.group(2), arg.group(3)
                if kind in (None, "string"):
                    arguments[key] = raw
                else:
                    try:
                        arguments[key] = json.loads(raw)
                    except ValueError:
                        arguments[key] = raw
            if self.options.allows(name):
                events.append(Event("call", name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
        return events


class KimiFormat(ToolFormat):
    name = "kimi"
    markers = (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, ARG_OPEN, CALL_CLOSE, "<think>", "</think>", OPEN, CLOSE, SEP)
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = SECTION_OPEN

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return SECTION_OPEN in template or SECTION_OPEN in special_tokens or (OPEN in template and 'argument key=' in template)

    def parser(self, options: ParserOptions) -> OutputParser:
        return KimiK3Parser(options) if options.variant == "k3" else KimiParser(options)

    def variant(self, prompt: str) -> str:
        """"k3" when the generation prompt uses K3's elements, else "k2"."""
        return "k3" if prompt.rfind(OPEN + "message") >= 0 else "k2"

    def prompt_in_reasoning(self, prompt: str) -> bool:
        if self.variant(prompt) == "k3":
            return prompt.rfind(OPEN + "think" + SEP) > max(prompt.rfind(CLOSE + "think"), prompt.rfind(OPEN + "response"))
        return super().prompt_in_reasoning(prompt)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{SECTION_OPEN}{CALL_OPEN}functions.{name}:0{ARG_OPEN}",
            "content": content,
            "end": f"{CALL_CLOSE}{SECTION_CLOSE}",
        }
