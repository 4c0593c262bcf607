"""``gemma4``: Gemma 4 calls in its object notation::

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,obj:{...},list:[...]}<tool_call|>

strings are delimited by ``<|"|>``, keys are bare; reasoning in ``<|channel>thought\\n...<channel|>``.
Format: Gemma 4's chat template (https://huggingface.co/google/gemma-4-31B-it) and Google's
Gemma function-calling docs (https://ai.google.dev/gemma/docs/capabilities/function-calling).
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tools.formats.base import BlockParser, OutputParser, ParserOptions, ToolFormat
from server.tools.formats.gemma4_grammar import arguments_grammar, notation

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
_CALL_RE = re.compile(r"call:([A-Za-z0-9_.\-]+)\s*(\{.*\})\s*$", re.S)
_BARE_RE = re.compile(r"([{,]\s*)([^:{}\[\],\"\s][^:{}\[\],\"]*?)\s*:")


class Gemma4Parser(BlockParser):
    think_open = (THOUGHT_OPEN,)
    think_close = (THOUGHT_CLOSE,)
    calls_end_reasoning = True
    openers = (CALL_OPEN,)
    strip_content = False

    def block_end(self, buf: str, final: bool) -> int | None:
        pos = len(CALL_OPEN)
        while True:
            close = buf.find(CALL_CLOSE, pos)
            quote = buf.find(QUOTE, pos)
            if close < 0:
                return None
            if 0 <= quote < close:
                end = buf.find(QUOTE, quote + len(QUOTE))
                if end < 0:
                    return None
                pos = end + len(QUOTE)
                continue
            return close + len(CALL_CLOSE)

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        body = block[len(CALL_OPEN) : -len(CALL_CLOSE)].strip()
        match = _CALL_RE.match(body)
        if match is None:
            return None
        arguments = to_json(match.group(2))
        return [(match.group(1), json.dumps(arguments, ensure_ascii=False))] if isinstance(arguments, dict) else None


def to_json(text: str) -> Any:
    """Gemma's object notation as a Python value (None when it is not well-formed)."""
    parts = text.split(QUOTE)
    if len(parts) % 2 == 0:
        return None
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(json.dumps(part, ensure_ascii=False))
        else:
            out.append(_BARE_RE.sub(lambda m: f'{m.group(1)}"{m.group(2)}":', part))
    try:
        return json.loads("".join(out))
    except ValueError:
        return None


class Gemma4Format(ToolFormat):
    name = "gemma4"
    markers = (CALL_OPEN, CALL_CLOSE, "<|tool_response>", "<tool_response|>", QUOTE, "<|channel>", THOUGHT_CLOSE)
    has_reasoning = True
    reasoning_open = (THOUGHT_OPEN,)
    reasoning_close = (THOUGHT_CLOSE,)
    trigger = CALL_OPEN

    @classmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        return CALL_OPEN in template or CALL_OPEN in special_tokens

    def parser(self, options: ParserOptions) -> OutputParser:
        return Gemma4Parser(options)

    #: Gemma's object notation has no xgrammar style: :mod:`.gemma4_grammar` writes the grammar.
    argument_style = "gemma4"

    def argument_grammar(self, schema: dict[str, Any]) -> str:
        return arguments_grammar(schema)

    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{CALL_OPEN}call:{name}", "content": content, "end": CALL_CLOSE}

    def call_text(self, name: str, arguments: str) -> str:
        return f"{CALL_OPEN}call:{name}{notation(json.loads(arguments or '{}'))}{CALL_CLOSE}"
