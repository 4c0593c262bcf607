"""The engine's own drafts through the OpenAI SDK against a real server: same answer with
``speculation: off``, the drafts counted in usage and /metrics, a bad value refused."""

from __future__ import annotations

import httpx
import openai
import pytest

# The tiny random model copies its context: a prompt that repeats itself gives drafts to keep
# (prompt lookup drafts for constrained answers: extraction, tool calls).
MESSAGES = [{"role": "user", "content": "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"}]
WORDS = "( (alpha|beta|gamma|delta))+"


def chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=32,
                                          extra_body={"ignore_eos": True, "guided_regex": WORDS, **extra})


def test_drafts_keep_the_answer_and_are_reported(tiny_server, monkeypatch):
    # the tiny model's forward costs less than verifying: the cost policy would price drafts out
    monkeypatch.setattr(tiny_server.state.engine.drafts.policy, "worth", lambda acceptance, tokens: True)
    client = tiny_server.client()
    off = chat(client, speculation="off")
    auto = chat(client, speculation="auto")
    assert auto.choices[0].message.content == off.choices[0].message.content
    assert off.usage.completion_tokens_details is None
    details = auto.usage.completion_tokens_details
    assert details is not None and details.model_extra["accepted_draft_tokens"] > 0
    assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
    metrics = httpx.get(tiny_server.base_url + "/metrics", timeout=30).text
    kept = [line for line in metrics.splitlines() if line.startswith("trellis_prompt_lookup_draft_tokens_accepted ")]
    assert kept and float(kept[0].split()[-1]) > 0


def test_an_unknown_speculation_value_is_a_400_naming_it(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(tiny_server.client(), speculation="always")
    assert caught.value.body["param"] == "speculation" and "auto, off" in caught.value.body["message"]
