"""close_on_length end to end through the `openai` SDK with the tiny random model: outputs parse
and validate at every budget from the shortest complete output up, and finish with ``length``
when the budget ended them."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer", "minimum": 10},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


def _create(client, max_tokens: int, close: bool | None = True, seed: int = 0, **extra):
    body = {"structured_outputs": {"json": SCHEMA, **({} if close is None else {"close_on_length": close})}, **extra}
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A person as JSON."}],
        max_tokens=max_tokens, temperature=1.0, seed=seed, extra_body=body,
    )


def _shortest(client) -> int:
    """The smallest budget the server accepts (found from its 400 message)."""
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, 1)
    assert err.value.body["param"] == "max_tokens"
    return int(re.search(r"needs (\d+) tokens", err.value.body["message"]).group(1))


def test_output_validates_at_every_budget_from_the_shortest_up(tiny_server):
    client = tiny_server.client()
    shortest = _shortest(client)
    assert 5 < shortest < 60
    finishes = set()
    for budget in range(shortest, shortest + 25):
        choice = _create(client, budget, seed=budget).choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        finishes.add(choice.finish_reason)
    assert finishes <= {"stop", "length"} and "length" in finishes


def test_budget_below_the_shortest_output_is_400(tiny_server):
    client = tiny_server.client()
    shortest = _shortest(client)
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, shortest - 1)
    assert err.value.body["param"] == "max_tokens" and "close_on_length" in err.value.body["message"]


def test_without_close_on_length_a_small_budget_cuts_the_output(tiny_server):
    client = tiny_server.client()
    shortest = _shortest(client)
    cut = [_create(client, shortest, close=None, seed=s).choices[0] for s in range(4)]
    assert any(c.finish_reason == "length" for c in cut)
    for choice in cut:
        if choice.finish_reason == "length":
            with pytest.raises(json.JSONDecodeError):
                json.loads(choice.message.content)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}", "close_on_length": True}},
         lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", text)),
        ({"structured_outputs": {"choice": ["positive", "negative"], "close_on_length": True}},
         lambda text: text in ("positive", "negative")),
        ({"structured_outputs": {"grammar": 'start: "(" start ")" | "x"', "close_on_length": True}},
         lambda text: re.fullmatch(r"(\(*)x(\)*)", text) and text.count("(") == text.count(")")),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"close_on_length": True}},
         lambda text: isinstance(json.loads(text), dict)),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": SCHEMA, "close_on_length": True}}},
         lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ],
    ids=["regex", "choice", "lark", "json_object", "response_format"],
)
def test_every_constraint_kind_closes(tiny_server, extra, check):
    client = tiny_server.client()
    low = 12 if "structured_outputs" in extra else _shortest(client)
    for budget in (low, low + 1, low + 5, low + 18):
        choice = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=budget,
            temperature=1.0, seed=budget, extra_body=extra,
        ).choices[0]
        assert check(choice.message.content), (budget, choice.message.content)


def test_streamed_output_closes(tiny_server):
    client = tiny_server.client()
    shortest = _shortest(client)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=shortest + 3,
        temperature=1.0, seed=7, stream=True, extra_body={"structured_outputs": {"json": SCHEMA, "close_on_length": True}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"close_on_length": True}}, "structured_outputs.close_on_length"),
        ({"structured_outputs": {"json": SCHEMA, "close_on_length": "yes"}}, "structured_outputs.close_on_length"),
    ],
)
def test_bad_close_on_length_is_400(tiny_server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        tiny_server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=20, extra_body=extra)
    assert err.value.body["param"] == param


CONTAINS = {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 7}, "minContains": 2, "maxContains": 3}


def test_contains_grammar_closes_and_validates_through_the_sdk(tiny_server):
    """``contains``/``minContains``/``maxContains`` on an array of any length (compiled as a Lark
    grammar) with a random model: from the shortest budget the server accepts up, every output,
    cut by the budget or not, is a valid instance."""
    client = tiny_server.client()

    def create(budget: int, seed: int = 0):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Numbers, some of them 7 or more."}],
            max_tokens=budget, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": CONTAINS, "close_on_length": True}},
        )

    with pytest.raises(openai.BadRequestError) as err:
        create(1)
    shortest = int(re.search(r"needs (\d+) tokens", err.value.body["message"]).group(1))
    for seed, budget in enumerate((shortest, shortest + 3, shortest + 20)):
        reply = create(budget, seed)
        jsonschema.validate(json.loads(reply.choices[0].message.content), CONTAINS)
        assert reply.usage.completion_tokens <= budget
