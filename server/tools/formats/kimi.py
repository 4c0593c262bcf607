"""``kimi``: Kimi K2 / K2.5 / K2.6 calls::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

reasoning in ``<think>...</think>``. Format: Kimi-K2's tool-call guide
(https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/docs/tool_call_guidance.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat, json_object_end, loads_object

SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_OPEN, ARG_OPEN, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID_RE = re.compile(r"^\s*(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::\d+)?\s*$")


class KimiParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
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


class KimiFormat(ToolFormat):
    name = "kimi"
    markers = (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, ARG_OPEN, CALL_CLOSE, "<think>", "</think>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = SECTION_OPEN

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return SECTION_OPEN in template or SECTION_OPEN in special_tokens

    def parser(self, options: ParserOptions) -> OutputParser:
        return KimiParser(options)

    def call_tag(self, name: str, grammar: str) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{SECTION_OPEN}{CALL_OPEN}functions.{name}:0{ARG_OPEN}",
            "content": {"type": "grammar", "grammar": grammar},
            "end": f"{CALL_CLOSE}{SECTION_CLOSE}",
        }
