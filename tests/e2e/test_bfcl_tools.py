"""End to end: BFCL function definitions as tools, forced calls from the default model.

The BFCL subsets of the shared MaskBench data hold function-argument schemas (one function per
schema, or an ``anyOf`` of several) and a ground-truth call for each. Every selected row becomes a
chat request through the ``openai`` SDK with its functions as ``tools`` and ``tool_choice``
"required"; the user asks, in plain words, for what the ground-truth call does. Every answer must
be a complete call (finish_reason "tool_calls") to one of the tools, with arguments that parse as
JSON and validate against that tool's ``parameters``.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jsonschema.validators import validator_for

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "maskbench"
SUBSETS = ("simple", "multiple", "parallel", "parallel_multiple", "java", "javascript", "sql")
PER_SUBSET = 10  # 70 forced calls: the real model at 16 in flight takes about a minute here
MIN_CASES = 60
IN_FLIGHT = 16
MAX_TOKENS = 384
SAMPLING: dict[str, Any] = {"temperature": 0}


@dataclass(frozen=True)
class Case:
    file: str
    tools: list[dict[str, Any]]
    prompt: str

    @property
    def parameters(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}


def _name(raw: str) -> str:
    """A BFCL function name (``math.hypot``) as an OpenAI function name (``math_hypot``)."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", raw)[:64]


def _words(raw: str) -> str:
    """``math.triangle_area_heron`` -> "math triangle area heron"; camelCase split too."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", raw)
    return " ".join(re.split(r"[^a-zA-Z0-9]+", spaced)).strip().lower()


def _prompt(raw: str, arguments: dict[str, Any]) -> str:
    """The user's request: what the ground-truth call does, its arguments given as JSON."""
    return f"Please {_words(raw)} with these arguments: {json.dumps(arguments, ensure_ascii=False)}"


def _case(row: dict[str, Any]) -> Case | None:
    schema = row["schema"]
    functions: dict[str, dict[str, Any]] = {}
    for alternative in schema.get("anyOf", [schema]):
        ((raw, parameters),) = alternative["properties"].items()
        functions[raw] = parameters
    if len({_name(raw) for raw in functions}) != len(functions):
        return None
    valid = [t["data"] for t in row["tests"] if t["valid"]]
    if not valid:
        return None
    ((raw, arguments),) = valid[0].items()
    tools = [
        {
            "type": "function",
            "function": {"name": _name(f), "description": _words(f).capitalize() + ".", "parameters": p},
        }
        for f, p in functions.items()
    ]
    return Case(row["file"], tools, _prompt(raw, arguments))


def cases() -> Iterator[Case]:
    """The first ``PER_SUBSET`` usable rows of every BFCL subset."""
    for subset in SUBSETS:
        path = DATA / f"BFCL_{subset}.jsonl.gz"
        if not path.is_file():
            continue
        taken = 0
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                case = _case(json.loads(line))
                if case is None:
                    continue
                yield case
                taken += 1
                if taken == PER_SUBSET:
                    break


def check(client, case: Case, **sampling: Any) -> str | None:
    """None when the answer is valid, else what is wrong with it."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": case.prompt}],
        tools=case.tools,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        **(SAMPLING | sampling),
    )
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or not calls or choice.message.content is not None:
        return f"finish_reason {choice.finish_reason}, {len(calls)} calls, content {choice.message.content!r:.300}"
    for call in calls:
        schema = case.parameters.get(call.function.name)
        if schema is None:
            return f"call to unknown tool {call.function.name!r}"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as exc:
            return f"arguments are not JSON ({exc}): {call.function.arguments!r:.300}"
        errors = list(validator_for(schema)(schema).iter_errors(arguments))
        if errors:
            return f"arguments invalid ({errors[0].message}): {call.function.arguments!r:.300}"
    return None


def test_bfcl_required_calls_are_valid(real_server) -> None:
    if not DATA.is_dir():
        pytest.skip(f"shared MaskBench data not found at {DATA}")
    selected = list(cases())
    if len(selected) < MIN_CASES:
        pytest.skip(f"only {len(selected)} BFCL rows found under {DATA}")
    client = real_server.client(timeout=600)
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        problems = list(pool.map(lambda case: check(client, case), selected))
    failures = [f"{case.file}: {problem}" for case, problem in zip(selected, problems) if problem]
    tools = sum(len(case.tools) for case in selected)
    print(f"\nBFCL tools: {len(selected) - len(failures)}/{len(selected)} calls valid ({tools} tool definitions)")
    assert not failures, f"{len(failures)} of {len(selected)} invalid:\n" + "\n".join(failures)
