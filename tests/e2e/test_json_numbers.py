"""Numbers in JSON answers keep the bounded form by default (issue #30 item 5): through the HTTP
API with the ``openai`` SDK, on the tiny random-weight model, whose unconstrained digits run on
forever; ``json_numbers: "any"`` lifts the bound and a bad value is a 400 naming it."""

from __future__ import annotations

import json

import openai
import pytest

from constraints.schema.number_form import NumberForm

SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}, "count": {"type": "integer"}},
          "required": ["total", "count"], "additionalProperties": False}


def _ask(server, **json_schema_extra):
    return server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "The invoice total?"}], max_tokens=120, temperature=0,
        seed=3, response_format={"type": "json_schema",
                                 "json_schema": {"name": "invoice", "schema": SCHEMA, **json_schema_extra}})


def test_numbers_are_bounded_by_default(tiny_server):
    reply = _ask(tiny_server)
    text = reply.choices[0].message.content
    assert NumberForm.accepts(text), text
    assert reply.choices[0].finish_reason == "stop" and set(json.loads(text)) == {"total", "count"}


def test_json_numbers_any_and_a_bad_value(tiny_server):
    unbounded = _ask(tiny_server, json_numbers="any").choices[0].message.content
    assert not NumberForm.accepts(unbounded), unbounded  # the tiny model's digits run on without the bound
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(tiny_server, json_numbers="short")
    assert caught.value.body["param"] == "response_format.json_schema.json_numbers"
