"""Property order through the HTTP API with the ``openai`` SDK, on the tiny random-weight model:
by default an object of 5 or more properties is written in the order the schema lists them;
``json_property_order: "any"`` lets them come in any order (the answer is valid JSON of the schema
whatever order the model picks); a bad value is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

NAMES = ["vendor", "customer", "invoice_number", "date", "total", "currency"]
SCHEMA = {"type": "object", "properties": {n: {"type": "string", "maxLength": 12} for n in NAMES},
          "required": NAMES[:4], "additionalProperties": False}


def _ask(server, seed: int, **json_schema_extra) -> str:
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Extract the invoice."}], max_tokens=200,
        temperature=1.0, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "invoice", "schema": SCHEMA, **json_schema_extra}})
    assert reply.choices[0].finish_reason == "stop"
    return reply.choices[0].message.content


def test_any_order_answers_are_valid(tiny_server):
    for seed in range(4):
        value = json.loads(_ask(tiny_server, seed, json_property_order="any"))
        jsonschema.validate(value, SCHEMA)
        assert len(value) == len(set(value))


@pytest.mark.parametrize("order", [None, "declared"])
def test_declared_order_by_default_and_on_request(tiny_server, order):
    for seed in range(3):
        text = _ask(tiny_server, seed, **({"json_property_order": order} if order else {}))
        keys = list(json.loads(text))
        jsonschema.validate(json.loads(text), SCHEMA)
        assert keys == [n for n in NAMES if n in keys], text


def test_a_bad_value_is_a_400(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(tiny_server, 0, json_property_order="sorted")
    assert caught.value.body["param"] == "response_format.json_schema.json_property_order"
