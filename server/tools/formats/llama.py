"""``llama``: Llama 3.x JSON calls and Llama 4 pythonic calls.

* Llama 3.1-3.3: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` accepted too), optionally after ``<|python_tag|>`` (which may follow text);
* Llama 4: ``[name(arg=value, ...), ...]`` (Python call syntax), optionally wrapped in
  ``<|python_start|>...<|python_end|>``.

Format: Meta's prompt-format docs (https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/
and .../llama4/), and the Llama 3.1 chat template's JSON tool-call instructions.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat, json_object_end, loads_object

PYTHON_TAG, EOM = "<|python_tag|>", "<|eom_id|>"
PY_START, PY_END = "<|python_start|>", "<|python_end|>"


class LlamaParser(BlockParser):
    openers = (PYTHON_TAG, PY_START)
    strip_content = False

    def start_opener(self, buf: str) -> str | None:
        if buf[0] in "{[":
            return buf[0]
        return None

    def block_end(self, buf: str, final: bool) -> int | None:
        if self.opener == PY_START:
            end = buf.find(PY_END)
            return end + len(PY_END) if end >= 0 else None
        return len(buf) if final else None  # a call is the rest of the reply

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block
        for marker in (PYTHON_TAG, PY_START):
            body = body.removeprefix(marker)
        body = body.removesuffix(PY_END).strip().removesuffix(EOM).strip()
        if body.startswith("{"):
            return _json_call(body)
        if body.startswith("["):
            return _pythonic_calls(body)
        return None


def _json_call(body: str) -> list[tuple[str, str]] | None:
    """Calls as JSON objects separated by ``;`` or whitespace; a last object left unclosed (the
    reply was cut by ``max_tokens``) is dropped when complete calls precede it."""
    calls = []
    pos = 0
    while pos < len(body):
        end = json_object_end(body, pos)
        if end is None and calls and body[pos] == "{":
            return calls
        obj = loads_object(body[pos:end]) if end else None
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("parameters", obj.get("arguments"))
        if not isinstance(arguments, dict):
            return None
        calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _pythonic_calls(body: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError):
            return None
    return calls


class LlamaFormat(ToolFormat):
    name = "llama"
    markers = (PYTHON_TAG, EOM, PY_START, PY_END, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    # "required"/named: the reply is the JSON call itself; "auto": a call follows <|python_tag|>,
    # so that free text can never be mistaken for the start of a call.
    trigger = PYTHON_TAG
    auto_prefix = PYTHON_TAG
    separator = "; "

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return ("<|start_header_id|>" in template or "<|header_start|>" in template) and "tools" in template

    def parser(self, options: ParserOptions) -> OutputParser:
        return LlamaParser(options)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
            "content": content,
            "end": "}",
        }
