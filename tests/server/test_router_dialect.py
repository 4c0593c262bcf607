"""The model router's dialect: /v0 routes, drop_params (dropped names in a header), model@provider,
/v0/endpoints, tags (array or comma-separated, counted), per-request body logging, system_fingerprint."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai

MODEL = "tiny"
HEADER = "x-trellis-dropped-params"


def _post(server, path: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **fields}
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_v0_drops_unsupported_and_unknown_params_and_names_them(tiny_server):
    response = _post(tiny_server, "/v0/chat/completions", use_beam_search=True, frobnicate=1,
                     messages=[{"role": "user", "content": "Hi", "mood": "happy"}])
    assert response.status_code == 200, response.text
    assert set(response.headers[HEADER].split(",")) == {"frobnicate", "messages[0].mood", "use_beam_search"}
    assert response.json()["system_fingerprint"].startswith("fp_")


def test_v1_refuses_unless_drop_params(tiny_server):
    refused = _post(tiny_server, "/v1/chat/completions", frobnicate=1)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frobnicate"
    dropped = _post(tiny_server, "/v1/chat/completions", frobnicate=1, drop_params=True)
    assert dropped.status_code == 200 and dropped.headers[HEADER] == "frobnicate"
    strict_v0 = _post(tiny_server, "/v0/chat/completions", frobnicate=1, drop_params=False)
    assert strict_v0.status_code == 400
    clean = _post(tiny_server, "/v0/chat/completions")
    assert clean.status_code == 200 and HEADER not in clean.headers


def test_model_at_provider_and_endpoints(tiny_server):
    endpoints = httpx.get(tiny_server.base_url + "/v0/endpoints").json()
    assert endpoints == [f"{MODEL}@trellis"]
    assert _post(tiny_server, "/v1/chat/completions", model=f"{MODEL}@trellis").status_code == 200
    unknown = _post(tiny_server, "/v0/chat/completions", model=f"{MODEL}@elsewhere")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    text = httpx.post(tiny_server.base_url + "/v0/completions", timeout=60,
                      json={"model": f"{MODEL}@trellis", "prompt": "Once", "max_tokens": 2, "best_of": 3})
    assert text.status_code == 200 and text.headers[HEADER] == "best_of"


def test_sdk_against_v0(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v0", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=f"{MODEL}@trellis", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, extra_body={"signature": "sdk-test", "region": "eu"})
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_tags_are_counted_and_bodies_logged_on_request(tiny_server, caplog):
    with caplog.at_level(logging.INFO, logger="trellis.access"):
        response = httpx.post(tiny_server.base_url + "/v0/chat/completions", timeout=60,
                              headers={"x-request-id": "tagged-1"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                    "tags": "alpha, beta", "log_query_body": True, "log_response_body": True,
                                    "signature": "pipeline-7"})
        assert response.status_code == 200
        deadline = time.time() + 5
        while time.time() < deadline and not any("tagged-1" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    line = next(json.loads(r.getMessage()) for r in caplog.records if "tagged-1" in r.getMessage())
    assert line["tags"] == ["alpha", "beta"] and line["signature"] == "pipeline-7"
    assert json.loads(line["query_body"])["tags"] == "alpha, beta"
    assert json.loads(line["response_body"])["id"] == response.json()["id"]
    metrics = httpx.get(tiny_server.base_url + "/metrics").text
    assert 'trellis_tagged_requests_total{tag="alpha"}' in metrics


def test_dropped_names_that_are_not_header_safe_are_encoded(tiny_server):
    """Found by the OpenAPI fuzzer: a client's odd field name once made the header illegal."""
    response = _post(tiny_server, "/v0/chat/completions", **{"b\u00e4d name\r\n": 1})
    assert response.status_code == 200, response.text
    assert response.headers[HEADER] == "b%C3%A4d%20name%0D%0A"


def test_return_routed_experts_is_dropped_on_v0_and_refused_on_v1(tiny_server):
    dropped = _post(tiny_server, "/v0/chat/completions", return_routed_experts=True)
    assert dropped.status_code == 200, dropped.text
    assert dropped.headers[HEADER] == "return_routed_experts"
    with_flag = _post(tiny_server, "/v1/chat/completions", return_routed_experts=True, drop_params=True)
    assert with_flag.status_code == 200 and with_flag.headers[HEADER] == "return_routed_experts"
    refused = _post(tiny_server, "/v1/chat/completions", return_routed_experts=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_routed_experts"


def test_clamped_max_tokens_is_in_the_request_log(tiny_server, caplog):
    """/v0 clamps max_tokens beyond the context (the header is checked in test_knobs.py); the log says so."""
    prompt = " ".join(["word"] * (4096 - 12))
    room = tiny_server.settings.max_model_len - len(tiny_server.state.tokenizer(prompt).input_ids)
    assert 0 < room < 100
    with caplog.at_level(logging.INFO, logger="trellis.access"):
        response = httpx.post(tiny_server.base_url + "/v0/completions", timeout=120,
                              headers={"x-request-id": "clamp-1"},
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.headers["x-trellis-clamped-max-tokens"] == f"100->{room}"
        deadline = time.time() + 5
        while time.time() < deadline and not any("clamp-1" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    line = next(json.loads(r.getMessage()) for r in caplog.records if "clamp-1" in r.getMessage())
    assert line["clamped_max_tokens"] == [f"100->{room}"]
