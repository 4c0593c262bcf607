"""End to end: each model family's tool-call format through the official `openai` SDK against a
real server running a tiny random-weight model.

The session's tiny server serves every family by the request's own ``chat_template`` (a minimal
template per family, ``family_templates.py``): the format follows from the template, the grammar
forces calls in that format and the family's parser turns them into ``tool_calls``. A second tiny
model carries the Mistral template and markers as special tokens in its tokenizer, so the format
is detected at start-up, with no template in the request. Random weights make the calls
meaningless but the structure exact: every call must name an offered tool and its arguments must
validate against the tool's schema, streamed and not.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from jsonschema.validators import validator_for

from tests.e2e.family_templates import SPECIAL_TOKENS, TEMPLATES

FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "Weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 9}, "on": {"type": "boolean"}},
            "required": ["hour", "on"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [FORECAST, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FAMILIES = sorted(TEMPLATES)
ASK = [{"role": "user", "content": "Forecast for three days, please."}]
FOLLOW_UP = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_forecast", "arguments": '{"unit": "c", "days": 3}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


def _create(client, family: str | None, *, stream: bool = False, messages=ASK, **fields: Any):
    extra = {"chat_template": TEMPLATES[family]} if family else {}
    return client.chat.completions.create(
        model=client._model, messages=messages, tools=TOOLS, temperature=0, max_tokens=160,
        stream=stream, extra_body=extra, **fields,
    )


def _collect(stream) -> dict[str, Any]:
    """What a client accumulates from the chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def _calls(message) -> list[dict[str, str]]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def _problems(calls: list[dict[str, str]]) -> list[str]:
    out = []
    for call in calls:
        schema = SCHEMAS.get(call["name"])
        if schema is None:
            out.append(f"unknown tool {call['name']!r}")
            continue
        errors = list(validator_for(schema)(schema).iter_errors(json.loads(call["arguments"])))
        out += [f"{call['name']}: {e.message}" for e in errors]
    return out


@pytest.fixture(scope="module")
def answers(tiny_server) -> dict[tuple[str, str], Any]:
    """Every family's requests, sent at once (the engine batches them)."""
    client = tiny_server.client(timeout=600)
    client._model = "tiny"
    jobs = {}
    for family in FAMILIES:
        jobs[(family, "required")] = lambda f=family: _create(client, f, tool_choice="required", parallel_tool_calls=False)
        jobs[(family, "stream")] = lambda f=family: _collect(
            _create(client, f, stream=True, tool_choice="required", parallel_tool_calls=False)
        )
        jobs[(family, "named")] = lambda f=family: _create(client, f, tool_choice=NAMED)
        jobs[(family, "parallel")] = lambda f=family: _create(client, f, tool_choice="required")
        jobs[(family, "auto")] = lambda f=family: _create(client, f, messages=FOLLOW_UP)
    with ThreadPoolExecutor(8) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_required_single_call(answers, family: str) -> None:
    choice = answers[(family, "required")].choices[0]
    calls = _calls(choice.message)
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message.content)
    assert len(calls) == 1 and choice.message.content is None
    assert _problems(calls) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_equals_non_streamed(answers, family: str) -> None:
    whole = answers[(family, "required")].choices[0]
    streamed = answers[(family, "stream")]
    assert streamed["finish"] == whole.finish_reason
    assert streamed["content"] == whole.message.content
    assert streamed["calls"] == _calls(whole.message)


@pytest.mark.parametrize("family", FAMILIES)
def test_named_tool(answers, family: str) -> None:
    choice = answers[(family, "named")].choices[0]
    calls = _calls(choice.message)
    assert calls and {c["name"] for c in calls} == {"set_alarm"}
    assert _problems(calls) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_calls_all_valid(answers, family: str) -> None:
    choice = answers[(family, "parallel")].choices[0]
    calls = _calls(choice.message)
    assert choice.finish_reason in ("tool_calls", "length")
    assert calls and _problems(calls) == []  # a call cut by max_tokens is never returned


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_after_a_tool_result(answers, family: str) -> None:
    """History with an assistant call and a tool result renders in the family's template; whatever
    the model answers, any call it makes is valid and markers never reach the content."""
    choice = answers[(family, "auto")].choices[0]
    assert _problems(_calls(choice.message)) == []
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")


# --------------------------------------------------------------------------- detected at start-up


@pytest.fixture(scope="module", params=["mistral", "gemma4"])
def detected_server(request, tiny_model_dir, tmp_path_factory):
    """A tiny model whose tokenizer has the family's markers as special tokens and its template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from server.config import Settings
    from server.model_loader import ModelSource
    from tests.conftest import start_server

    family = request.param
    directory: Path = tmp_path_factory.mktemp(f"tiny-{family}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[family]})
    tokenizer.chat_template = TEMPLATES[family]
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    name = f"tiny-{family}"
    settings = Settings(model=str(directory), served_model_name=name, max_batch_size=4, max_model_len=2048)
    running, stop = start_server(settings, ModelSource(directory, name=name))
    yield family, running
    stop()


def test_format_detected_from_the_models_template(detected_server) -> None:
    """Detected at start-up; markers are single special tokens, and the grammar still forces
    exactly one valid call in the family's format (streamed the same)."""
    from server.tools.select import server_format

    family, server = detected_server
    fmt, how = server_format(server.state)
    assert (fmt.name, how) == (family, "detected")
    client = server.client(timeout=600)
    client._model = f"tiny-{family}"
    reply = _create(client, None, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
    assert len(choice.message.tool_calls) == 1 and _problems(_calls(choice.message)) == []
    streamed = _collect(_create(client, None, stream=True, tool_choice="required", parallel_tool_calls=False))
    assert streamed["calls"] == _calls(choice.message)
    named = _create(client, None, tool_choice=NAMED).choices[0]
    assert {c["name"] for c in _calls(named.message)} == {"set_alarm"} and _problems(_calls(named.message)) == []
