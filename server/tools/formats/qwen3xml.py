"""``qwen3-xml``: Qwen3-Coder / Qwen3.5+ XML parameters::

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

Values are bare text, typed by the parameter's schema. Format: Qwen3-Coder's chat template
(https://huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct, ``chat_template.jinja``) and its
reference parser ``qwen3coder_tool_parser.py`` in the same repository.
"""

from __future__ import annotations

import re
from typing import Any

from server.tools.formats.base import (
    BlockParser,
    OutputParser,
    ParserOptions,
    ToolFormat,
    coerce_value,
    dumps_arguments,
    param_schema,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)(?=\n?</parameter>|\n?<parameter=|\n?</function>|$)", re.S)


class Qwen3XmlParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    openers = (CALL_OPEN, FUNCTION_OPEN)
    calls_end_reasoning = True

    def block_end(self, buf: str, final: bool) -> int | None:
        close = buf.find(FUNCTION_CLOSE)
        if close < 0:
            return None
        end = close + len(FUNCTION_CLOSE)
        rest = buf[end:].lstrip()
        if rest.startswith(CALL_CLOSE):
            return len(buf) - len(rest) + len(CALL_CLOSE)
        if CALL_CLOSE.startswith(rest) and not final:
            return None
        return end

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        start = block.find(FUNCTION_OPEN)
        head_end = block.find(">", start)
        close = block.rfind(FUNCTION_CLOSE)
        if start < 0 or head_end < 0 or close < head_end:
            return None
        if block[:start].strip() not in ("", CALL_OPEN):
            return None
        name = block[start + len(FUNCTION_OPEN) : head_end].strip()
        body = block[head_end + 1 : close]
        arguments: dict[str, Any] = {}
        for match in _PARAM_RE.finditer(body):
            key = match.group(1).strip()
            raw = match.group(2)
            if raw.startswith("\n"):
                raw = raw[1:]
            raw = raw.removesuffix("\n") if raw.endswith("\n") else raw
            arguments[key] = coerce_value(raw, param_schema(self.options, name, key))
        rest = _PARAM_RE.sub("", body).replace("</parameter>", "")
        if rest.strip():
            return None
        return [(name, dumps_arguments(arguments))]


class Qwen3XmlFormat(ToolFormat):
    name = "qwen3-xml"
    markers = (CALL_OPEN, CALL_CLOSE, FUNCTION_OPEN, FUNCTION_CLOSE, "<parameter=", "</parameter>", "<think>", "</think>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = CALL_OPEN
    separator = "\n"

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return "<function=" in template and "<parameter=" in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return Qwen3XmlParser(options)

    def call_tag(self, name: str, grammar: str) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n",
            "content": {"type": "grammar", "grammar": grammar},
            "end": f"\n{FUNCTION_CLOSE}\n{CALL_CLOSE}",
        }
