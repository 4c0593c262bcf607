"""``mistral``: ``[TOOL_CALLS]`` calls. Three generations of the format:

* v3 (Mistral-7B-v0.3, Nemo): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
* v11+ (Mistral-Small-3.x, Devstral, Magistral): ``[TOOL_CALLS]NAME[ARGS]{...}`` per call,
  optionally ``[CALL_ID]id`` before ``[ARGS]``;
* reasoning in ``[THINK]...[/THINK]`` (Magistral, v13).

Format: mistral-common's tokenizer docs (https://docs.mistral.ai/guides/tokenization/) and its
``InstructTokenizer`` encodings of tool calls.
"""

from __future__ import annotations

import json
from typing import Any

from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat, json_object_end, loads_object

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser(BlockParser):
    think_open = ("[THINK]", "<think>")
    think_close = ("[/THINK]", "</think>")
    openers = (TOOL_CALLS,)

    def block_end(self, buf: str, final: bool) -> int | None:
        pos = len(TOOL_CALLS)
        while pos < len(buf) and buf[pos] in " \t\r\n":
            pos += 1
        if pos == len(buf):
            return None
        if buf[pos] == "[":
            end = json_object_end(buf, pos)
            return end if end is not None else (len(buf) if final else None)
        args = buf.find(ARGS, pos)
        if args < 0:
            return len(buf) if final else None
        start = args + len(ARGS)
        while start < len(buf) and buf[start] in " \t\r\n":
            start += 1
        if start == len(buf):
            return None
        if buf[start] != "{":
            return len(buf) if final else None
        end = json_object_end(buf, start)
        return end

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block[len(TOOL_CALLS) :].strip()
        if body.startswith("["):
            try:
                items = json.loads(body)
            except ValueError:
                return None
            calls = []
            for item in items if isinstance(items, list) else []:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    return None
                arguments = item.get("arguments", {})
                if isinstance(arguments, str):
                    arguments = loads_object(arguments)
                if not isinstance(arguments, dict):
                    return None
                calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
            return calls or None
        if ARGS not in body:
            return None
        head, arguments = body.split(ARGS, 1)
        name = head.split(CALL_ID, 1)[0].strip()
        arguments = arguments.strip()
        if not name or loads_object(arguments) is None:
            return None
        return [(name, arguments)]


class MistralFormat(ToolFormat):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID, "[THINK]", "[/THINK]")
    has_reasoning = True
    reasoning_open = ("[THINK]",)
    reasoning_close = ("[/THINK]",)
    trigger = TOOL_CALLS

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return TOOL_CALLS in template or TOOL_CALLS in special_tokens

    def parser(self, options: ParserOptions) -> OutputParser:
        return MistralParser(options)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{TOOL_CALLS}{name}{ARGS}", "content": content, "end": ""}
