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

import json
import re
from typing import Any

from server.tools.formats.base import (
    BlockParser,
    OutputParser,
    ParserOptions,
    ToolFormat,
    coerce_value,
    dumps_arguments,
    loads_object,
    param_schema,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"


class Qwen3XmlParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    openers = (CALL_OPEN, FUNCTION_OPEN)
    calls_end_reasoning = True

    def block_end(self, buf: str, final: bool) -> int | None:
        match = _BLOCK_END.search(buf)
        if match is not None:
            return match.end()
        if final and buf.rstrip().endswith(FUNCTION_CLOSE):  # a bare <function=...> call at the end
            return len(buf.rstrip())
        return None

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        start = block.find(FUNCTION_OPEN)
        head_end = block.find(">", start)
        close = block.rfind(FUNCTION_CLOSE)
        if start < 0 or head_end < 0 or close < head_end or block[:start].strip() not in ("", CALL_OPEN):
            return None
        name = block[start + len(FUNCTION_OPEN) : head_end].strip()
        arguments = _parameters(block[head_end + 1 : close], lambda key: param_schema(self.options, name, key))
        return None if arguments is None else [(name, dumps_arguments(arguments))]


_BLOCK_END = re.compile(r"</function>\s*</tool_call>")
_PARAM_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
_PARAM_CLOSE = re.compile(r"\n?</parameter>\s*(?=<parameter=[^>\n]+>|\Z)")
_NEXT_PARAM = re.compile(r"\n(?=<parameter=[^>\n]+>\n)|\n?\Z")


def _parameters(body: str, schema_of) -> dict[str, Any] | None:
    """``<parameter=K>\\nV\\n</parameter>`` pairs (one newline after the opening and before the
    closing tag belongs to the markup); a closing tag counts only where the next parameter or the
    end follows, so values may contain the markers; a missing ``</parameter>`` ends at the next
    parameter."""
    arguments: dict[str, Any] = {}
    pos = 0
    while body[pos:].strip():
        opened = _PARAM_OPEN.match(body, pos)
        if opened is None:
            return None
        key = opened.group(1).strip()
        found = [m for m in (_PARAM_CLOSE.search(body, opened.end()), _NEXT_PARAM.search(body, opened.end())) if m]
        closed = min(found, key=lambda m: m.start())
        arguments[key] = coerce_value(body[opened.end() : closed.start()], schema_of(key))
        pos = closed.end()
    return arguments


class Qwen3XmlFormat(ToolFormat):
    name = "qwen3-xml"
    markers = (CALL_OPEN, CALL_CLOSE, FUNCTION_OPEN, FUNCTION_CLOSE, "<parameter=", "</parameter>", "<think>", "</think>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = CALL_OPEN
    separator = "\n"
    argument_style = "qwen_xml"

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return "<function=" in template and "<parameter=" in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return Qwen3XmlParser(options)

    def call_text(self, name: str, arguments: str) -> str:
        params = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in (loads_object(arguments) or {}).items()
        )
        return f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{CALL_CLOSE}"

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n",
            "content": content,  # xgrammar's qwen_xml style: <parameter=K>V</parameter>
            "end": f"\n{FUNCTION_CLOSE}\n{CALL_CLOSE}",
        }
