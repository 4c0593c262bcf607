"""HTTP behaviour of the OpenAI-compatible API, against a real uvicorn server and a tiny random model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

MODEL = "tiny"


def post(server, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60, **kwargs)


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, **fields}
    return post(server, "/v1/chat/completions", body)


def sse_chunks(response: httpx.Response) -> list:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --------------------------------------------------------------------------- basics


def test_models_health_and_request_id(tiny_server):
    models = httpx.get(tiny_server.base_url + "/v1/models")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert models.headers["x-request-id"]
    health = httpx.get(tiny_server.base_url + "/health", headers={"x-request-id": "abc123"})
    assert health.json()["status"] == "ok"
    assert health.headers["x-request-id"] == "abc123"


def test_openapi_schema_served(tiny_server):
    schema = httpx.get(tiny_server.base_url + "/docs/openapi.json")
    assert schema.status_code == 200
    assert "/v1/chat/completions" in schema.json()["paths"]


def test_chat_non_stream_shape_and_length_limit(tiny_server):
    body = chat(tiny_server, max_tokens=5, ignore_eos=True).json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_sdk_chat_and_stream_assemble_same_text(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "user", "content": "Count to ten"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_n_choices_are_independent_and_indexed(tiny_server):
    body = chat(tiny_server, n=3, max_tokens=6, seed=1, ignore_eos=True).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = {c["message"]["content"] for c in body["choices"]}
    assert len(texts) > 1
    assert body["usage"]["completion_tokens"] == 18


def test_seed_reproducible_under_concurrent_load(tiny_server):
    alone = chat(tiny_server, seed=1234, max_tokens=10, ignore_eos=True).json()["choices"][0]["message"]["content"]
    results: list[str] = []

    def noisy() -> None:
        chat(tiny_server, max_tokens=30, ignore_eos=True, temperature=1.0)

    threads = [threading.Thread(target=noisy) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    results.append(chat(tiny_server, seed=1234, max_tokens=10, ignore_eos=True).json()["choices"][0]["message"]["content"])
    for t in threads:
        t.join()
    assert results == [alone]


def test_stop_string_cuts_output(tiny_server):
    base = chat(tiny_server, seed=5, max_tokens=24, ignore_eos=True).json()["choices"][0]["message"]["content"]
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), "random output should have some text"
    cut = chat(tiny_server, seed=5, max_tokens=24, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["stop_reason"] == stop
    assert cut["message"]["content"] == base[: base.index(stop)]
    kept = chat(tiny_server, seed=5, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.json()["choices"][0]["message"]["content"] == base[: base.index(stop) + len(stop)]


def test_stream_with_stop_never_leaks_stop_text(tiny_server):
    base = chat(tiny_server, seed=9, max_tokens=24, ignore_eos=True).json()["choices"][0]["message"]["content"]
    stop = base[10:14]
    response = chat(tiny_server, seed=9, max_tokens=24, ignore_eos=True, stop=stop, stream=True)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(response) if c["choices"])
    assert text == base[: base.index(stop)]


def test_logprobs_shape(tiny_server):
    body = chat(tiny_server, logprobs=True, top_logprobs=3, max_tokens=4, ignore_eos=True).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert entry["bytes"] == list(entry["token"].encode())


def test_min_tokens_and_greedy_are_honoured(tiny_server):
    a = chat(tiny_server, temperature=0, max_tokens=8, min_tokens=8).json()
    b = chat(tiny_server, temperature=0, max_tokens=8, min_tokens=8).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] == 8


def test_extra_body_literal_object_is_merged(tiny_server):
    response = chat(tiny_server, extra_body={"ignore_eos": True, "min_tokens": 3}, max_tokens=3)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_text_completions_with_echo_and_token_prompt(tiny_server):
    body = post(tiny_server, "/v1/completions",
                {"model": MODEL, "prompt": ["Once upon", [1, 2, 3]], "max_tokens": 4, "echo": True,
                 "ignore_eos": True, "logprobs": 2}).json()
    assert body["object"] == "text_completion"
    assert len(body["choices"]) == 2
    assert body["choices"][0]["text"].startswith("Once upon")
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 4
    assert body["usage"]["completion_tokens"] == 8


def test_text_completion_stream(tiny_server):
    response = post(tiny_server, "/v1/completions",
                    {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True, "ignore_eos": True})
    chunks = sse_chunks(response)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
        ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_fields_get_400_naming_the_field(tiny_server, fields, param):
    assert_error(chat(tiny_server, **fields), 400, param)


def test_unknown_model_is_404(tiny_server):
    assert_error(chat(tiny_server, model="gpt-99"), 404, "model")


def test_invalid_json_and_non_object_body(tiny_server):
    assert_error(post(tiny_server, "/v1/chat/completions", b"{not json"), 400)
    assert_error(post(tiny_server, "/v1/chat/completions", b"[1, 2]"), 400)


def test_missing_messages(tiny_server):
    assert_error(post(tiny_server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")


def test_prompt_longer_than_context(tiny_server):
    long = "word " * 5000
    error = assert_error(chat(tiny_server, messages=[{"role": "user", "content": long}], max_tokens=None), 400)
    assert error["code"] == "context_length_exceeded"


def test_unknown_route_is_openai_404(tiny_server):
    assert_error(httpx.get(tiny_server.base_url + "/v1/nothing"), 404)


def test_sdk_raises_bad_request(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert info.value.body["param"] == "temperature"


# --------------------------------------------------------------------------- engine behaviour over HTTP


def _wait_idle(server, timeout: float = 3.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = httpx.get(server.base_url + "/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {health}")


def test_client_disconnect_frees_sequence(tiny_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                assert httpx.get(tiny_server.base_url + "/health").json()["running"] >= 1
                break
    _wait_idle(tiny_server)


def test_non_stream_disconnect_frees_sequence(tiny_server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
                       "ignore_eos": True}).encode()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/v1/chat/completions", content=body, timeout=0.3,
                   headers={"content-type": "application/json"})
    _wait_idle(tiny_server)


def test_concurrent_requests_share_decode_steps(tiny_server):
    stats = tiny_server.state.engine.stats
    steps, tokens = stats.steps, stats.decode_tokens
    threads = [threading.Thread(target=chat, args=(tiny_server,), kwargs={"max_tokens": 40, "ignore_eos": True})
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (stats.decode_tokens - tokens) / (stats.steps - steps) > 2.0


def test_tool_schema_keyword_that_cannot_be_enforced_is_refused(tiny_server):
    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
    error = assert_error(chat(tiny_server, tools=[tool], tool_choice="required"), 400, "tools[0].function.parameters")
    assert "uniqueItems" in error["message"] and "/properties/tags" in error["message"]


def test_continuous_usage_stats_on_every_chunk(tiny_server):
    response = chat(tiny_server, max_tokens=4, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c for c in sse_chunks(response) if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert chunks and all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] <= 4


def test_continue_final_message_with_echo(tiny_server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, the answer"}]
    body = chat(tiny_server, messages=messages, continue_final_message=True, add_generation_prompt=False,
                echo=True, max_tokens=3, ignore_eos=True).json()
    assert body["choices"][0]["message"]["content"].startswith("Well, the answer")
