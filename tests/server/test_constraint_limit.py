"""A constraint that hits a parser limit mid-generation (after the rescue replay with more fuel)
fails only its own request, as a 400 naming the cause, streaming or not; the engine goes on."""

from __future__ import annotations

import uuid

import openai
import pytest

from server.generation import generation_error

# a key new to every run: the server's disk cache must not hand back another run's compilation
KEY = f"limit_probe_{uuid.uuid4().hex[:8]}"
SCHEMA = {"type": "object", "properties": {KEY: {"type": "string"}}, "required": [KEY]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "probe", "strict": True, "schema": SCHEMA}}


@pytest.fixture
def starved_llguidance(monkeypatch):
    """llguidance matchers report a parser limit (as after a failed rescue replay) from their first
    accepted token on; the real limit and its rescue are tested in tests/constraints."""
    from constraints.backends.llguidance import LLGuidanceMatcher

    def error(self):
        return "lexer error: too many expressions constructed" if self._history else None

    monkeypatch.setattr(LLGuidanceMatcher, "error", property(error))


def _chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, response_format=FORMAT, **extra)


def test_a_parser_limit_is_a_400_naming_it(tiny_server, starved_llguidance):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client)
    body = err.value.body
    assert body["code"] == "constraint_limit" and "parser limit" in body["message"], body
    with pytest.raises(openai.APIError, match="parser limit") as streamed:
        for _ in _chat(client, stream=True):
            pass
    assert streamed.value.body["code"] == "constraint_limit"
    assert tiny_server.state.engine.alive
    free = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert free.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("message, status, code", [
    ("the constraint hit a parser limit mid-generation: lexer error", 400, "constraint_limit"),
    ("constraint matcher failed: RuntimeError: bug", 500, "generation_error"),
])
def test_generation_error_status(message, status, code):
    error = generation_error(message)
    assert (error.status, error.code) == (status, code)
