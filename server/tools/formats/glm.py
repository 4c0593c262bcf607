"""``glm``: GLM-4.5 / 4.6 / 4.7 / 5 calls::

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    </tool_call>

(newlines optional from 4.7 on); reasoning in ``<think>...</think>``. Values are bare text typed by
the parameter's schema. Format: GLM-4.5's chat template (https://huggingface.co/zai-org/GLM-4.5,
``chat_template.jinja``) and Z.ai's function-calling docs.
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
_PAIR_RE = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|\Z)", re.S)


class GlmParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    calls_end_reasoning = True
    openers = (CALL_OPEN,)

    def block_end(self, buf: str, final: bool) -> int | None:
        pos = len(CALL_OPEN)
        while True:
            close = buf.find(CALL_CLOSE, pos)
            value = buf.find("<arg_value>", pos)
            if close < 0:
                return None
            if 0 <= value < close:  # a value may contain the closing marker: skip past the value
                end = buf.find("</arg_value>", value)
                if end < 0:  # at the end, a value left open closes with the call
                    last = buf.rfind(CALL_CLOSE)
                    return last + len(CALL_CLOSE) if final and last > value and not buf[last + len(CALL_CLOSE) :].strip() else None
                pos = end + len("</arg_value>")
                continue
            return close + len(CALL_CLOSE)

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block[len(CALL_OPEN) : -len(CALL_CLOSE)]
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not name or "<" in name:
            return None
        arguments: dict[str, Any] = {}
        rest = "" if first < 0 else body[first:]
        pos = 0
        for match in _PAIR_RE.finditer(rest):
            if match.start() != pos:
                return None
            key = match.group(1).strip()
            arguments[key] = coerce_value(match.group(2), param_schema(self.options, name, key))
            pos = match.end()
        if rest[pos:].strip():
            return None
        return [(name, dumps_arguments(arguments))]


class GlmFormat(ToolFormat):
    name = "glm"
    markers = (CALL_OPEN, CALL_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>", "</think>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = CALL_OPEN

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return "<arg_key>" in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return GlmParser(options)

    def call_text(self, name: str, arguments: str) -> str:
        pairs = "".join(
            f"<arg_key>{key}</arg_key>\n<arg_value>{value if isinstance(value, str) else json.dumps(value)}</arg_value>\n"
            for key, value in (loads_object(arguments) or {}).items()
        )
        return f"{CALL_OPEN}{name}\n{pairs}{CALL_CLOSE}"

    argument_style = "glm_xml"

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{CALL_OPEN}{name}\n", "content": content, "end": CALL_CLOSE}
