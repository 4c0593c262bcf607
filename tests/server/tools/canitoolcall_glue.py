"""Glue between canitoolcall's fixtures and Trellis's tool-call parsers (used by the conformance
tests and by ``benchmarks/canitoolcall_counts.py``-style summaries)."""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

from canitoolcall.fixtures import Fixture
from canitoolcall.pytest_plugin import family_for
from canitoolcall.results import ParsedToolCall, ParseResult

from server.tools.formats import ParserOptions, get_format
from server.tools.formats.base import Event


def options_for(fixture: Fixture) -> ParserOptions:
    """Parser options as the server would build them for the fixture's request."""
    fmt = get_format(fixture.family)
    functions = [t.get("function", t) for t in fixture.tools]
    names = frozenset(f["name"] for f in functions if isinstance(f, dict) and "name" in f)
    schemas = {f["name"]: f.get("parameters") or {} for f in functions if isinstance(f, dict) and "name" in f}
    prompt = generation_prompt(fixture)
    return ParserOptions(
        names=names, in_reasoning=fmt.prompt_in_reasoning(prompt), schemas=schemas, variant=fmt.variant(prompt)
    )


def generation_prompt(fixture: Fixture) -> str:
    """The fixture's generation prompt, or its reference model's default one."""
    if fixture.generation_prompt is not None:
        return fixture.generation_prompt
    family = family_for(fixture)
    for ref in getattr(family, "reference_models", ()) or ():
        repo = ref.get("repo") if isinstance(ref, dict) else getattr(ref, "repo", None)
        if repo == fixture.reference_model:
            prompt = ref.get("default_generation_prompt") if isinstance(ref, dict) else getattr(ref, "default_generation_prompt", None)
            return prompt or ""
    return ""


def to_result(events: list[Event]) -> ParseResult:
    """Events accumulated the way an OpenAI client accumulates deltas."""
    content = "".join(e.text for e in events if e.kind == "content") or None
    reasoning = "".join(e.text for e in events if e.kind == "reasoning") or None
    calls = tuple(ParsedToolCall(name=e.name, arguments_raw=e.arguments) for e in events if e.kind == "call")
    return ParseResult(content=content, reasoning_content=reasoning, tool_calls=calls)


def parse_whole(fixture: Fixture) -> ParseResult:
    parser = get_format(fixture.family).parser(options_for(fixture))
    return to_result(parser.parse(fixture.raw_output))


def parse_stream(fixture: Fixture, deltas: list[str]) -> ParseResult:
    parser = get_format(fixture.family).parser(options_for(fixture))
    events: list[Event] = []
    for delta in deltas:
        events += parser.feed(delta)
    events += parser.finish()
    return to_result(events)


@cache
def _marker_re(family: str) -> re.Pattern[str]:
    fmt = get_format(family)
    markers = sorted(set(fmt.markers), key=len, reverse=True)
    return re.compile("|".join(re.escape(m) for m in markers))


def text_units(fixture: Fixture, tokenizer: Any) -> tuple[list[str], set[int]]:
    """The raw output as token-sized text pieces and the indices of the special ones: the
    family's markers are atomic pieces, text between them is split where the default model's
    tokenizer splits it (its offsets)."""
    text = fixture.raw_output
    units: list[str] = []
    special: set[int] = set()
    pos = 0
    for match in list(_marker_re(fixture.family).finditer(text)) + [None]:
        end = match.start() if match else len(text)
        if end > pos:
            units += _token_pieces(text[pos:end], tokenizer)
        if match:
            special.add(len(units))
            units.append(match.group())
            pos = match.end()
    return units, special


def _token_pieces(text: str, tokenizer: Any) -> list[str]:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cuts = sorted({0, len(text), *(start for start, _ in offsets)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def dump(result: ParseResult) -> str:
    return json.dumps(result.to_dict(), ensure_ascii=False)
