"""Trellis on Ray Serve: a local Ray instance, 2 replicas of the tiny model behind one entry point.

Requests are spread over both replicas; a long shared prefix always lands on the same replica; a
replica killed mid-run loses no request that had not started streaming, and Ray replaces it.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")

import httpx  # noqa: E402

from server.config import Settings  # noqa: E402
from server.model_loader import ModelSource  # noqa: E402
from tests.conftest import free_port  # noqa: E402

REPLICA = "x-trellis-replica"
LONG_PREFIX = "You are a careful assistant for the archive of maritime records. " * 24


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    from ray import serve

    from server.scaleout.launch import APP_NAME, deploy, shutdown

    cache = tmp_path_factory.mktemp("scaleout")
    settings = Settings(
        model=str(tiny_model_dir), served_model_name="tiny", max_batch_size=4, max_model_len=2048,
        compile_workers=1, port=free_port(), database_url=str(cache / "store.sqlite3"),
        constraint_cache_dir=str(cache / "constraints"), log_requests=False,
        ray=True, replicas=2, cpus_per_replica=1.0, request_timeout=120,
    )
    url = deploy(settings, ModelSource(tiny_model_dir, name="tiny"))
    try:
        _wait_running(serve, APP_NAME, replicas=2)
        yield url
    finally:
        shutdown()


def _wait_running(serve, app_name: str, replicas: int, timeout: float = 120.0) -> None:
    """Until the app runs with ``replicas`` running engine replicas."""
    from server.scaleout.launch import REPLICA_DEPLOYMENT

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "RUNNING":
            deployment = app.deployments[REPLICA_DEPLOYMENT]
            if deployment.replica_states.get("RUNNING", 0) == replicas:
                return
        time.sleep(0.5)
    raise AssertionError(f"the app did not reach {replicas} running replicas: {serve.status()}")


def _chat(url: str, content: str, *, max_tokens: int = 4, stream: bool = False, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_requests_are_served_by_both_replicas(cluster):
    replicas = set()
    for i in range(16):
        response = _chat(cluster, f"Question number {i}: what is {i} + {i}?")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
        replicas.add(response.headers[REPLICA])
    assert len(replicas) == 2


def test_same_long_prefix_lands_on_the_same_replica(cluster):
    served = {_chat(cluster, LONG_PREFIX + f" Tail {i}.").headers[REPLICA] for i in range(8)}
    assert len(served) == 1
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    format_ = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    constrained = set()
    for i in range(4):
        response = _chat(cluster, LONG_PREFIX + f" Count {i}.", max_tokens=16, response_format=format_)
        assert response.status_code == 200, response.text
        constrained.add(response.headers[REPLICA])
    assert len(constrained) == 1


def test_single_server_behaviour_through_the_entry_point(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_headers={"x-request-id": "abc-1"})
    assert raw.headers.get_list("x-request-id") == ["abc-1"]
    assert raw.headers[REPLICA]
    assert raw.parse().usage.completion_tokens >= 1

    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

    bad = _chat(cluster, "hi", not_a_field=1)
    assert bad.status_code == 400
    assert "not_a_field" in bad.json()["error"]["message"]
    assert bad.headers[REPLICA]
    assert httpx.get(cluster + "/nowhere").status_code == 404
    assert httpx.get(cluster + "/health").status_code == 200
    assert httpx.get(cluster + "/v1/models").json()["data"][0]["id"] == "tiny"

    metrics = httpx.get(cluster + "/metrics")
    assert metrics.status_code == 200
    replicas = metrics.headers[REPLICA].split(",")
    assert len(replicas) == 2
    for replica in replicas:
        assert f'trellis_requests_total{{replica="{replica}"' in metrics.text or f'replica="{replica}"' in metrics.text
    assert "trellis_scaleout_replicas 2.0" in metrics.text


def _stream_outcome(url: str, i: int) -> tuple[str, str]:
    """(replica, how the stream ended: 'done' or 'error')."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    saw_error = False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        replica = response.headers[REPLICA]
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"  # a stream always ends, also when its replica died
    for line in lines[:-1]:
        if "error" in json.loads(line[len("data: "):]):
            saw_error = True
    return replica, "error" if saw_error else "done"


def test_a_killed_replica_loses_no_unstarted_request_and_is_replaced(cluster):
    import ray
    from ray import serve

    from server.scaleout.launch import APP_NAME, REPLICA_DEPLOYMENT

    before = {_chat(cluster, f"warm {i}").headers[REPLICA] for i in range(12)}
    assert len(before) == 2
    victim = sorted(before)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve")

    with ThreadPoolExecutor(max_workers=12) as pool:
        streams = [pool.submit(_stream_outcome, cluster, i) for i in range(4)]
        plain = [pool.submit(_chat, cluster, f"plain {i}", max_tokens=48, ignore_eos=True) for i in range(8)]
        time.sleep(1.0)  # requests are in flight on both replicas
        threading.Thread(target=ray.kill, args=(actor,), kwargs={"no_restart": True}).start()
        results = [future.result(timeout=180) for future in plain]
        outcomes = [future.result(timeout=180) for future in streams]

    for response in results:  # not streaming: nothing had started, so each was retried if needed
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 48
    for replica, ending in outcomes:
        assert ending == "done" or replica == victim

    _wait_running(serve, APP_NAME, replicas=2)
    after = set()
    for i in range(16):
        response = _chat(cluster, f"after {i}")
        assert response.status_code == 200, response.text
        after.add(response.headers[REPLICA])
    assert victim not in after and len(after) == 2
