"""``deepseek``: DeepSeek V3 / R1, V3.1 and V3.2 / V4 (DSML) calls.

* V3/R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
* V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` in the same section
* V3.2 / V4: ``<｜DSML｜function_calls>`` (or ``tool_calls``) with ``<｜DSML｜invoke name="N">`` and
  ``<｜DSML｜parameter name="P" string="true|false">V</｜DSML｜parameter>``

reasoning in ``<think>...</think>``. Format: DeepSeek's chat templates and ``encoding`` scripts in
the model repositories (https://huggingface.co/deepseek-ai/DeepSeek-V3.1, .../DeepSeek-V3.2).
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat, json_object_end, loads_object

SECTION_OPEN, SECTION_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_OPEN, SEP, CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DSML = "｜DSML｜"
DSML_OPEN = "<" + DSML
_DSML_HEAD = re.compile(r"<｜DSML｜\s*(\w+)>")
_INVOKE = re.compile(r'<｜DSML｜\s*invoke\s+name="([^"]+)"\s*(?:/>|>(.*?)</｜DSML｜\s*invoke>)', re.S)
_PARAM = re.compile(r'<｜DSML｜\s*parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)</｜DSML｜\s*parameter>', re.S)


class DeepSeekParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    calls_end_reasoning = True
    openers = (SECTION_OPEN, DSML_OPEN)

    def block_end(self, buf: str, final: bool) -> int | None:
        if self.opener == DSML_OPEN:
            head = _DSML_HEAD.match(buf)
            if head is None:
                return None if not final and len(buf) < 40 and ">" not in buf else len(DSML_OPEN)
            close = re.compile(r"</｜DSML｜\s*" + re.escape(head.group(1)) + ">").search(buf, head.end())
            return close.end() if close else None
        end = buf.find(SECTION_CLOSE)
        return end + len(SECTION_CLOSE) if end >= 0 else None

    def salvage(self, buf: str) -> list[tuple[str, str]]:
        return (_dsml_calls(buf) or []) if self.opener == DSML_OPEN else []

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        if self.opener == DSML_OPEN:
            return _dsml_calls(block)
        body = block[len(SECTION_OPEN) : -len(SECTION_CLOSE)]
        calls = []
        pos = 0
        while True:
            while pos < len(body) and body[pos] in " \t\r\n":
                pos += 1
            if pos == len(body):
                return calls or None
            if not body.startswith(CALL_OPEN, pos):
                return None
            sep = body.find(SEP, pos)
            if sep < 0:
                return None
            head = body[pos + len(CALL_OPEN) : sep].strip()
            start = sep + len(SEP)
            name = head
            if head == "function":  # V3: name, then a ```json fence
                line_end = body.find("\n", start)
                if line_end < 0:
                    return None
                name = body[start:line_end].strip()
                start = line_end + 1
                if body.startswith("```json", start):
                    start += len("```json")
            while start < len(body) and body[start] in " \t\r\n":
                start += 1
            end = json_object_end(body, start) if start < len(body) and body[start] == "{" else None
            arguments = loads_object(body[start:end]) if end else None
            if arguments is None or not name:
                return None
            rest = body[end:].lstrip()
            if rest.startswith("```"):
                rest = rest[3:].lstrip()
            if not rest.startswith(CALL_CLOSE):
                return None
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            pos = len(body) - len(rest) + len(CALL_CLOSE)


def _dsml_calls(block: str) -> list[tuple[str, str]] | None:
    calls = []
    for invoke in _INVOKE.finditer(block):
        arguments: dict[str, Any] = {}
        for param in _PARAM.finditer(invoke.group(2) or ""):
            key, is_string, raw = param.group(1), param.group(2), param.group(3)
            if is_string == "false":
                try:
                    arguments[key] = json.loads(raw)
                except ValueError:
                    return None
            else:
                arguments[key] = raw
        calls.append((invoke.group(1), json.dumps(arguments, ensure_ascii=False)))
    return calls or None


class DeepSeekFormat(ToolFormat):
    name = "deepseek"
    markers = (SECTION_OPEN, SECTION_CLOSE, CALL_OPEN, SEP, CALL_CLOSE, DSML, "<think>", "</think>", "<｜end▁of▁sentence｜>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = SECTION_OPEN

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return SECTION_OPEN in template or SECTION_OPEN in special_tokens or DSML in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return DeepSeekParser(options)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{SECTION_OPEN}{CALL_OPEN}{name}{SEP}",
            "content": content,
            "end": f"{CALL_CLOSE}{SECTION_CLOSE}",
        }
