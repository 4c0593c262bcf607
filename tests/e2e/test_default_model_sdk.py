"""End to end: the official `openai` SDK against a real server running the embedded default model."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"


def ask(client, content: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def test_sensible_english_answer(real_server):
    reply = ask(real_server.client(), "What is the capital of France?", temperature=0, max_tokens=30)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens < 30


def test_stream_equals_non_stream_greedy(real_server):
    client = real_server.client()
    question = "Name three colors."
    full = ask(client, question, temperature=0, max_tokens=40).choices[0].message.content
    chunks = list(ask(client, question, temperature=0, max_tokens=40, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seed_n_and_max_tokens(real_server):
    client = real_server.client()
    a = ask(client, "Write a word.", seed=42, n=2, max_tokens=12, temperature=1.0)
    b = ask(client, "Write a word.", seed=42, n=2, max_tokens=12, temperature=1.0)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2
    long = ask(client, "Tell me a long story about dragons.", max_tokens=5, temperature=0)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 5


def test_stop_sequence(real_server):
    client = real_server.client()
    full = ask(client, "Count from 1 to 10, separated by commas.", temperature=0, max_tokens=40).choices[0]
    assert "5" in full.message.content
    cut = ask(client, "Count from 1 to 10, separated by commas.", temperature=0, max_tokens=40, stop=["5"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full.message.content[: full.message.content.index("5")]


def test_errors_through_sdk(real_server):
    client = real_server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "hi", max_tokens=10**6)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        ask(client, "hi", top_logprobs=50, logprobs=True)


def test_models_listing(real_server):
    models = real_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
