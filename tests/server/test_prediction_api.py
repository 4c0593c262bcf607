"""Predicted outputs and choice probabilities through the OpenAI SDK against a real server."""

from __future__ import annotations

import math

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Rewrite the numbers one to ten."}]
GREEDY = {"temperature": 0.0, "presence_penalty": 2.0, "max_tokens": 24}  # varied output from the tiny model


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **{**GREEDY, **kwargs})


def test_correct_prediction_same_output_fewer_steps(tiny_server):
    client = tiny_server.client()
    plain = chat(client)
    text = plain.choices[0].message.content
    stats = tiny_server.state.engine.stats
    steps_before = stats.steps
    predicted = chat(client, prediction={"type": "content", "content": text})
    steps = stats.steps - steps_before
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    # The random tiny model's text does not always re-tokenise into the tokens it generated, so
    # not every predicted token can match; most do, and they save steps.
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens // 2
    assert steps <= predicted.usage.completion_tokens - details.accepted_prediction_tokens
    plain_details = plain.usage.completion_tokens_details  # present when the engine's own drafts were fed
    assert plain_details is None or plain_details.accepted_prediction_tokens == plain_details.rejected_prediction_tokens == 0


def test_wrong_prediction_rejected_and_output_unchanged(tiny_server):
    client = tiny_server.client()
    plain = chat(client)
    wrong = [{"type": "text", "text": "Completely unrelated "}, {"type": "text", "text": "prediction text here."}]
    predicted = chat(client, prediction={"type": "content", "content": wrong})
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0 and details.accepted_prediction_tokens == 0


def test_streamed_usage_reports_prediction_tokens(tiny_server):
    client = tiny_server.client()
    text = chat(client).choices[0].message.content
    chunks = list(chat(client, prediction={"type": "content", "content": text}, stream=True,
                       stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.accepted_prediction_tokens >= usage.completion_tokens // 2


@pytest.mark.parametrize("prediction, param", [
    ({"type": "image", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0]"),
])
def test_bad_prediction_is_400(tiny_server, prediction, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(tiny_server.client(), prediction=prediction)
    assert info.value.body["param"] == param


def test_chat_choice_logprobs(tiny_server):
    choices = ["red", "green", "dark blue", "light yellow"]
    response = chat(tiny_server.client(), logprobs=True, extra_body={"guided_choice": choices})
    scored = response.choices[0].choice_logprobs
    assert [entry["choice"] for entry in scored] == choices
    values = [entry["logprob"] for entry in scored]
    assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-6)
    assert response.choices[0].message.content == choices[values.index(max(values))]


def test_completion_choice_logprobs_streamed_and_not(tiny_server):
    client = tiny_server.client()
    choices = ["alpha", "beta gamma", "delta"]
    body = {"structured_outputs": {"choice": choices}}
    done = client.completions.create(model="tiny", prompt="Pick one:", logprobs=1, temperature=0.0,
                                     max_tokens=10, extra_body=body)
    values = [entry["logprob"] for entry in done.choices[0].choice_logprobs]
    assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-6)
    assert done.choices[0].text == choices[values.index(max(values))]
    chunks = list(client.completions.create(model="tiny", prompt="Pick one:", logprobs=1, temperature=0.0,
                                            max_tokens=10, extra_body=body, stream=True))
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [e["logprob"] for e in final[0].choice_logprobs] == pytest.approx(values, abs=1e-5)


def test_choices_without_logprobs_are_not_scored(tiny_server):
    response = chat(tiny_server.client(), extra_body={"guided_choice": ["red", "green"]})
    assert response.choices[0].choice_logprobs is None
    assert response.choices[0].message.content in ("red", "green")
