"""Data-driven: BFCL function schemas from the shared MaskBench data as tool parameters.

Each BFCL schema is an object with one property (the function name, whose schema is the
parameters) or an ``anyOf`` of such objects (several functions). For every usable schema this
builds the tools, compiles the "required" structural tag with xgrammar, and walks one valid
instance, written as a call, through the matcher token by token; the parser must recover it.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.errors import APIError

from server.tools import format_call, parse_tool_output, tool_structural_tag

from .toolcases import matches, plan_for

DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "maskbench"
MIN_CHECKED = 100


def _name(raw: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_-]", "_", raw)[:64]


def _functions(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{function name: parameters schema} of one BFCL schema."""
    out = {}
    for alternative in schema.get("anyOf", [schema]):
        ((raw, parameters),) = alternative["properties"].items()
        out[raw] = parameters
    return out


def _cases() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for path in sorted(DATA.glob("BFCL_*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                valid = [t["data"] for t in row["tests"] if t["valid"]]
                if valid:
                    yield row["file"], _functions(row["schema"]), valid[0]


def _check(
    file: str, functions: dict[str, Any], instance: dict[str, Any], compiler: Any, tokenizer: Any
) -> str | None:
    names = {raw: _name(raw) for raw in functions}
    if len(set(names.values())) != len(names):
        return "skip"
    tools = [
        {"type": "function", "function": {"name": names[raw], "parameters": params}}
        for raw, params in functions.items()
    ]
    plan = plan_for(tools, tool_choice="required")
    ((raw, arguments),) = instance.items()
    text = format_call(names[raw], json.dumps(arguments, ensure_ascii=False))
    try:
        tag = tool_structural_tag(plan)
    except APIError as error:  # refused up front, naming the keyword: never half-enforced
        assert error.code == "unsupported_constraint" and error.param.startswith("tools["), error.message
        return "refused"
    if not matches(compiler, tokenizer, tag, text, tokens=True):
        return f"{file}: valid call rejected: {text[:200]}"
    content, calls = parse_tool_output(text, plan)
    if content is not None or len(calls) != 1 or json.loads(calls[0].function.arguments) != arguments:
        return f"{file}: parser did not recover the call"
    return None


def test_bfcl_schemas_as_tools(compiler: Any, tokenizer: Any) -> None:
    if not DATA.is_dir():
        pytest.skip(f"shared MaskBench data not found at {DATA}")
    failures, checked, refused = [], 0, 0
    for file, functions, instance in _cases():
        problem = _check(file, functions, instance, compiler, tokenizer)
        if problem == "skip":
            continue
        if problem == "refused":
            refused += 1
            continue
        checked += 1
        if problem:
            failures.append(problem)
    assert checked >= MIN_CHECKED
    assert refused <= 0.01 * checked, f"{refused} tool schemas refused as not enforceable"
    assert not failures, f"{len(failures)} of {checked} failed:\n" + "\n".join(failures[:20])
