"""Structured outputs end to end: every request form, through the `openai` SDK, with the default model.

Outputs that finish with ``stop`` must validate (jsonschema) / fullmatch the regex / parse by the
grammar / equal a choice; bad constraints must come back as 400s naming the field.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def ask(client, content: str, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def person_json(choice) -> dict:
    assert choice.finish_reason == "stop", choice
    data = json.loads(choice.message.content)
    jsonschema.validate(data, PERSON)
    return data


def test_response_format_json_schema(real_server):
    reply = ask(real_server.client(), "Describe a person as JSON.",
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person_json(reply.choices[0])
    content = reply.choices[0].message.content
    if "\\" not in content:  # the default layout is json.dumps's, byte for byte
        assert content == json.dumps(json.loads(content), ensure_ascii=False)


TREE = {
    "$defs": {"node": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
        "required": ["name", "children"],
        "additionalProperties": False,
    }},
    "$ref": "#/$defs/node",
}


def test_recursive_schema_fits_a_small_budget(real_server):
    prompt = "A family tree as JSON: a root named Ann with two children, Bo and Cy, who have no children."
    reply = ask(real_server.client(), prompt, max_tokens=100, response_format={"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert "\n" not in choice.message.content
    jsonschema.validate(json.loads(choice.message.content), TREE)


def test_json_object_mode(real_server):
    # close_on_length: whether the model stops by itself or the budget ends, the content parses
    reply = ask(real_server.client(), "Give me a JSON object describing a cat.", response_format={"type": "json_object"},
                max_tokens=48, extra_body={"structured_outputs": {"close_on_length": True}})
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice
    assert isinstance(json.loads(choice.message.content), dict)


class Weather(BaseModel):
    city: str
    temperature_celsius: int
    sunny: bool


def test_parse_with_pydantic_model(real_server):
    completion = real_server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris? Answer as JSON."}],
        response_format=Weather, temperature=0, max_tokens=100,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_json": PERSON},
        {"guided_json": json.dumps(PERSON)},
        {"structured_outputs": {"json": PERSON}},
        {"json_schema": json.dumps(PERSON)},
    ],
    ids=["guided_json", "guided_json_str", "structured_outputs", "sglang_json_schema"],
)
def test_json_schema_request_forms(real_server, extra):
    person_json(ask(real_server.client(), "Describe a person as JSON.", extra_body=extra).choices[0])


PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.mark.parametrize(
    "extra",
    [{"guided_regex": PHONE}, {"structured_outputs": {"regex": PHONE}}, {"regex": PHONE}],
    ids=["guided_regex", "structured_outputs", "sglang_regex"],
)
def test_regex_request_forms(real_server, extra):
    choice = ask(real_server.client(), "Give me a US phone number.", extra_body=extra).choices[0]
    assert choice.finish_reason == "stop"
    assert re.fullmatch(PHONE, choice.message.content, re.ASCII)  # \d means [0-9], as in ECMA-262


CHOICES = ["positive", "negative", "neutral"]


@pytest.mark.parametrize(
    "extra", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}], ids=["guided", "structured"]
)
def test_choice_request_forms(real_server, extra):
    choice = ask(real_server.client(), "Sentiment of 'I love this!'?", extra_body=extra).choices[0]
    assert choice.message.content in CHOICES


EBNF = 'root ::= "The answer is " [0-9]+ "."'


@pytest.mark.parametrize(
    "extra",
    [{"guided_grammar": EBNF}, {"structured_outputs": {"grammar": EBNF}}, {"ebnf": EBNF}],
    ids=["guided_grammar", "structured_outputs", "sglang_ebnf"],
)
def test_grammar_request_forms(real_server, extra):
    choice = ask(real_server.client(), "What is 2+2?", extra_body=extra).choices[0]
    assert choice.finish_reason == "stop"
    assert re.fullmatch(r"The answer is [0-9]+\.", choice.message.content)


def test_lark_grammar_detected(real_server):
    lark = 'start: "yes" | "no"'
    choice = ask(real_server.client(), "Is the sky blue?", extra_body={"guided_grammar": lark}).choices[0]
    assert choice.message.content in ("yes", "no")


def test_streamed_json_schema_assembles_valid(real_server):
    chunks = list(ask(real_server.client(), "Describe a person as JSON.", stream=True,
                      response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_n_choices_each_constrained(real_server):
    reply = ask(real_server.client(), "Describe a person as JSON.", n=3, temperature=1.0, seed=3,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            person_json(choice)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_json": PERSON, "guided_regex": "a+"}, None),
    ],
    ids=["bad_schema_type", "bad_regex", "empty_choice", "bad_grammar", "two_constraints"],
)
def test_bad_constraints_are_400(real_server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        ask(real_server.client(), "hi", extra_body=extra)
    body = info.value.body
    assert body["message"]
    if param is not None:
        assert body["param"] and body["param"].startswith(param), body


def test_unenforceable_keyword_names_pointer(real_server):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True, "contains": {"const": "x"},
                                                        "minContains": 2}}}
    try:
        reply = ask(real_server.client(), "tags as JSON", response_format={"type": "json_schema",
                                                                            "json_schema": {"name": "t", "schema": schema}})
    except openai.BadRequestError as error:
        assert "/properties/tags" in error.body["message"]
        return
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # enforced exactly, so the output must validate
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_pathological_constraints_answer_within_budget_and_server_keeps_serving(real_server):
    client = real_server.client()
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    cases = [
        {"guided_json": deep},
        {"guided_json": {"type": "string", "enum": [f"value-{i}" for i in range(100_000)]}},
        {"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 100000, "maxItems": 100000}},
        {"guided_regex": "(a+)+$" * 20},
        {"guided_regex": "(x|x|x|y)*" * 50 + "[a-z]{1,1000}" * 20},
    ]

    def attempt(extra):
        started = time.perf_counter()
        try:
            ask(client, "hi", max_tokens=4, extra_body=extra)
            outcome = "ok"
        except openai.BadRequestError as error:
            outcome = error.body["code"]
        return outcome, time.perf_counter() - started

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(attempt, cases))
    budget = real_server.settings.compile_timeout
    for outcome, elapsed in results:
        assert elapsed < budget + 30, results  # no hang; the budget is enforced server-side
    # The server still serves ordinary and constrained requests afterwards.
    assert ask(client, "Say hi", max_tokens=5).choices[0].message.content
    person_json(ask(client, "Describe a person as JSON.", extra_body={"guided_json": PERSON}).choices[0])
