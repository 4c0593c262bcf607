"""``qwen3-hermes``: Hermes-style JSON calls, as Qwen2.5/Qwen3 (and Trellis's default prompt) write
them: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, reasoning in
``<think>...</think>``. Format: Qwen3's chat template and the Qwen function-calling docs
(https://qwen.readthedocs.io/en/latest/framework/function_call.html), NousResearch Hermes-2-Pro.
"""

from __future__ import annotations

from typing import Any

from server.tools.format import ARGS_CLOSE, CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, call_prefix
from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat, json_object_end, loads_object


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class HermesParser(BlockParser):
    think_open = ("<think>",)
    think_close = ("</think>",)
    openers = (CALL_OPEN,)
    calls_end_reasoning = True

    def block_end(self, buf: str, final: bool) -> int | None:
        pos = skip_ws(buf, len(self.opener))
        if pos == len(buf):
            return None
        if buf[pos] != "{":
            close = buf.find(CALL_CLOSE, pos)
            return close + len(CALL_CLOSE) if close >= 0 else None
        end = json_object_end(buf, pos)
        if end is None:
            return None
        after = skip_ws(buf, end)
        rest = buf[after : after + len(CALL_CLOSE)]
        if rest == CALL_CLOSE:
            return after + len(CALL_CLOSE)
        if CALL_CLOSE.startswith(rest) and not final:
            return None
        return end

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block[len(self.opener) :].strip()
        if body.endswith(CALL_CLOSE):
            body = body[: -len(CALL_CLOSE)].rstrip()
        obj = loads_object(body)
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        start = json_object_end(body, 0)
        if start is None:
            return None
        arguments = obj.get("arguments", obj.get("parameters"))
        if not isinstance(arguments, dict):
            return None
        return [(obj["name"], _raw_arguments(body, arguments))]


def _raw_arguments(body: str, arguments: dict[str, Any]) -> str:
    """The arguments object exactly as the model wrote it (located by its key)."""
    import json

    for key in ('"arguments"', '"parameters"'):
        at = body.find(key)
        while at >= 0:
            pos = skip_ws(body, at + len(key))
            if pos < len(body) and body[pos] == ":":
                pos = skip_ws(body, pos + 1)
                end = json_object_end(body, pos) if pos < len(body) and body[pos] == "{" else None
                if end is not None and loads_object(body[pos:end]) == arguments:
                    return body[pos:end]
            at = body.find(key, at + 1)
    return json.dumps(arguments, ensure_ascii=False)


class HermesFormat(ToolFormat):
    name = "qwen3-hermes"
    markers = (CALL_OPEN, CALL_CLOSE, "<think>", "</think>")
    has_reasoning = True
    reasoning_open = ("<think>",)
    reasoning_close = ("</think>",)
    trigger = CALL_OPEN
    separator = CALL_SEPARATOR

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return CALL_OPEN in template and '"arguments"' in template and "<function=" not in template and "<arg_key>" not in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return HermesParser(options)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": call_prefix(name), "content": content, "end": ARGS_CLOSE}
