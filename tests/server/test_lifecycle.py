"""Operating the server: error envelope, OpenAPI bodies, readiness, metrics, request log, SIGTERM drain,
client chat templates in a killable worker, and a dead engine turning /health red."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import free_port

MODEL = "tiny"


def _chat(server, timeout=60, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def test_error_body_carries_top_level_fields_and_request_id(tiny_server):
    response = httpx.post(tiny_server.base_url + "/v1/chat/completions", json={"model": MODEL, "bogus": 1},
                          headers={"x-request-id": "rid-42"})
    assert response.status_code == 400
    body = response.json()
    assert body["request_id"] == "rid-42" == response.headers["x-request-id"]
    assert body["code"] == body["error"]["code"] and body["message"] == body["error"]["message"]


def test_openapi_document_describes_bodies(tiny_server):
    document = httpx.get(tiny_server.base_url + "/docs/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request_schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "conversation", "response_format"} <= set(request_schema["properties"])
    assert {"200", "400", "429"} <= set(chat["responses"])
    assert {"/health", "/ready", "/metrics", "/v1/models"} <= set(document["paths"])


def test_ready_and_metrics_move(tiny_server):
    assert httpx.get(tiny_server.base_url + "/ready").status_code == 200
    before = _metric(tiny_server, 'trellis_requests_total{route="/v1/chat/completions",status="400"}')
    assert _chat(tiny_server, temperature=-1).status_code == 400
    assert _chat(tiny_server).status_code == 200
    after = _metric(tiny_server, 'trellis_requests_total{route="/v1/chat/completions",status="400"}')
    assert after == before + 1
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in ("trellis_running_sequences", "trellis_waiting_sequences", "trellis_time_to_first_token_seconds_count",
                 "trellis_generation_tokens_total", "trellis_prompt_tokens_total", "process_resident_memory_bytes"):
        assert name in text
    assert _metric(tiny_server, "trellis_time_to_first_token_seconds_count") >= 1


def _metric(server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_one_log_line_per_request(tiny_server, caplog):
    with caplog.at_level(logging.INFO, logger="trellis.access"):
        response = httpx.post(tiny_server.base_url + "/v1/chat/completions", headers={"x-request-id": "log-me"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert response.status_code == 200
        deadline = time.time() + 5
        while time.time() < deadline and not any("log-me" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    lines = [json.loads(r.getMessage()) for r in caplog.records if "log-me" in r.getMessage()]
    assert len(lines) == 1
    line = lines[0]
    assert line["status"] == 200 and line["path"] == "/v1/chat/completions"
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 3


def test_unsupported_content_type_is_415_and_missing_is_json(tiny_server):
    url = tiny_server.base_url + "/v1/chat/completions"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    refused = httpx.post(url, content=body, headers={"content-type": "text/plain"})
    assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.post(url, content=body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    request = httpx.Request("POST", url, content=body.encode())
    assert "content-type" not in request.headers
    with httpx.Client() as client:
        assert client.send(request).status_code == 200


# --------------------------------------------------------------------------- client chat templates


def test_client_template_renders_in_worker(tiny_server):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    response = _chat(tiny_server, chat_template=template, echo=False)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
])
def test_runaway_client_template_is_400_and_server_lives(tiny_server, template):
    started = time.monotonic()
    response = _chat(tiny_server, chat_template=template, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template"
    assert time.monotonic() - started < 30  # hang detector, not a benchmark
    assert _chat(tiny_server).status_code == 200


def test_raising_client_template_is_400(tiny_server):
    response = _chat(tiny_server, chat_template="{{ raise_exception('nope') }}")
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- the process


def _serve(model_dir, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRELLIS_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
         "--port", str(port), "--max-batch-size", "4", "--allow-client-chat-template", "off", *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model_dir):
    proc, base = _serve(tiny_model_dir, "--drain-timeout", "60")
    try:
        result: dict = {}

        def long_request() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                    "ignore_eos": True}
            result["response"] = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

        worker = threading.Thread(target=long_request)
        worker.start()
        _wait_for(lambda: "trellis_running_sequences 1.0" in httpx.get(base + "/metrics").text)
        proc.send_signal(signal.SIGTERM)
        refused = _wait_for(lambda: _refused(base))  # admission closes at once
        assert refused.json()["error"]["code"] == "server_draining"
        assert httpx.get(base + "/ready").status_code == 503
        worker.join(timeout=120)
        response = result["response"]
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _wait_for(probe, seconds: float = 60.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def _refused(base: str) -> httpx.Response | None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    response = httpx.post(base + "/v1/chat/completions", timeout=30, json=body)
    return response if response.status_code == 503 else None


def test_client_template_can_be_disabled(tiny_model_dir):
    proc, base = _serve(tiny_model_dir)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "chat_template": "{{ messages }}"}
        response = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_dead_engine_turns_health_red_and_watchdog_stops_the_server(tiny_model_dir):
    from server.cli import DrainingServer
    from server.config import Settings
    from server.model_loader import ModelSource
    from tests.conftest import start_server

    settings = Settings(model=str(tiny_model_dir), served_model_name=MODEL, max_batch_size=2)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name=MODEL))
    try:
        engine = running.state.engine

        def die() -> None:
            raise SystemExit("simulated engine crash")

        engine.step = die
        response = _chat(running)
        assert response.status_code == 500 and "engine stopped" in response.json()["error"]["message"]
        assert not engine.alive
        health = httpx.get(running.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert httpx.get(running.base_url + "/ready").status_code == 503
        assert _chat(running).json()["error"]["code"] == "engine_dead"

        class _Config:
            app = None

        watchdog = DrainingServer.__new__(DrainingServer)
        watchdog._state, watchdog.engine_failed = running.state, False
        watchdog._server = type("FakeUvicorn", (), {"should_exit": False, "config": _Config()})()
        watchdog._watch_engine()
        assert watchdog.engine_failed and watchdog._server.should_exit
    finally:
        stop()


def test_unknown_route_and_method_carry_request_id(tiny_server):
    for response in (httpx.get(tiny_server.base_url + "/v1/nothing", headers={"x-request-id": "r404"}),
                     httpx.get(tiny_server.base_url + "/v1/completions", headers={"x-request-id": "r404"})):
        assert response.status_code in (404, 405)
        assert response.headers["x-request-id"] == "r404" == response.json()["request_id"]


def test_restarted_server_loads_compiled_constraints_from_disk(tiny_model_dir, tmp_path):
    from server.config import Settings
    from server.model_loader import ModelSource
    from tests.conftest import start_server

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    settings = Settings(model=str(tiny_model_dir), served_model_name=MODEL, max_batch_size=2,
                        constraint_cache_dir=str(tmp_path / "constraints"))
    for run in range(2):  # the second server is a restart over the same cache directory
        running, stop = start_server(settings, ModelSource(tiny_model_dir, name=MODEL))
        try:
            response = _chat(running, guided_json=schema, max_tokens=30)
            assert response.status_code == 200, response.text
            stats = running.state.compiler.cache_stats()
            assert (stats["disk_writes"], stats["disk_hits"]) == ((1, 0) if run == 0 else (0, 1))
        finally:
            stop()
