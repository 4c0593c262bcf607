"""``return_hidden_states``: each output token's last-layer hidden state, from the forward that
produced it, equal to what transformers computes for the same tokens."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

PROMPT_IDS = [1, 504, 3458, 314, 260, 3575, 30]


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def transformers_hidden(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Final-norm hidden states at the positions whose logits chose each output token: [T, D]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states[-1][0]
    return states[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def test_completion_hidden_states_equal_transformers(tiny_server, reference_model):
    reply = tiny_server.client().completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=0.7, seed=3, logprobs=0,
        extra_body={"return_hidden_states": True, "ignore_eos": True},
    )
    hidden = torch.tensor(reply.choices[0].model_extra["hidden_states"])
    tokens = _token_ids(tiny_server, reply.choices[0].logprobs.tokens)
    assert hidden.shape == (8, reference_model.config.hidden_size)
    torch.testing.assert_close(hidden, transformers_hidden(reference_model, PROMPT_IDS, tokens), atol=1e-4, rtol=1e-4)


def _token_ids(server, token_texts: list[str]) -> list[int]:
    """Token ids of a reply, from the server's own tokenizer (each logprob entry is one token)."""
    tokenizer = server.state.tokenizer
    vocab = {tokenizer.decode([i], skip_special_tokens=False): i for i in range(len(tokenizer))}
    return [vocab[text] for text in token_texts]


def test_chat_hidden_states_streamed_equal_non_streamed(tiny_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_hidden_states": True}
    whole = httpx.post(tiny_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    hidden = whole["choices"][0]["hidden_states"]
    assert len(hidden) == whole["usage"]["completion_tokens"] == 6
    streamed = []
    with httpx.stream("POST", tiny_server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("hidden_states") or []
    assert streamed == hidden


def test_hidden_states_absent_unless_asked(tiny_server):
    reply = httpx.post(tiny_server.base_url + "/v1/completions",
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60).json()
    assert "hidden_states" not in reply["choices"][0]


def test_hidden_states_with_a_constraint_have_one_entry_per_token(tiny_server):
    body = {"model": "tiny", "prompt": "Pick:", "max_tokens": 20, "return_hidden_states": True,
            "guided_choice": ["alpha beta gamma", "delta"], "temperature": 0.0}
    reply = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert len(reply["choices"][0]["hidden_states"]) == reply["usage"]["completion_tokens"]


def test_routed_experts_refused_on_a_dense_model(tiny_server):
    with pytest.raises(openai.BadRequestError, match="mixture-of-experts") as info:
        tiny_server.client().completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                                extra_body={"return_routed_experts": True})
    assert info.value.body["param"] == "return_routed_experts"
