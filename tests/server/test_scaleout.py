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
        ray=True, replicas=2, cpus_per_replica=1.0, request_timeout=120, drain_timeout=5,
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


def _chat_body(content: str, *, max_tokens: int = 4, stream: bool = False, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def _chat(url: str, content: str, **options) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=_chat_body(content, **options), timeout=120)


def _prompts_preferring(replica: str, replicas: list[str], count: int, stem: str, **options) -> list[str]:
    """Prompts whose affinity key the cache-aware router sends to ``replica`` first."""
    import msgspec

    from server.scaleout.keys import affinity_key
    from server.scaleout.router import rendezvous_order

    chosen = []
    for i in range(1000):
        body = msgspec.json.encode(_chat_body(f"{stem} {i}", **options))
        if rendezvous_order(affinity_key("POST", "/v1/chat/completions", body), replicas)[0] == replica:
            chosen.append(f"{stem} {i}")
            if len(chosen) == count:
                return chosen
    raise AssertionError("no prompts found")


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


def _stream_outcome(url: str, content: str, started: threading.Event) -> tuple[str, str]:
    """(replica, how the stream ended: 'done' or 'error'); sets ``started`` at its first event."""
    lines = []
    body = _chat_body(content, **_LONG_STREAM)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        replica = response.headers[REPLICA]
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                started.set()
    assert lines[-1] == "data: [DONE]"  # a stream always ends, also when its replica died
    saw_error = any("error" in json.loads(line[len("data: "):]) for line in lines[:-1])
    return replica, "error" if saw_error else "done"


_LONG_STREAM = {"max_tokens": 400, "ignore_eos": True, "stream": True}
_LONG_PLAIN = {"max_tokens": 200, "ignore_eos": True}


def _retried(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("trellis_scaleout_retried_requests "):
            return float(line.split()[1])
    raise AssertionError("no trellis_scaleout_retried_requests in /metrics")


def test_a_killed_replica_loses_no_unstarted_request_and_is_replaced(cluster):
    import ray
    from ray import serve

    from server.scaleout.launch import APP_NAME, REPLICA_DEPLOYMENT

    replicas = sorted({_chat(cluster, f"warm {i}").headers[REPLICA] for i in range(12)})
    assert len(replicas) == 2
    victim, survivor = replicas
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve")
    retried_before = _retried(cluster)
    # Half of each kind prefers the replica that will die, so the kill always hits requests in flight.
    stream_prompts = (_prompts_preferring(victim, replicas, 2, "stream", **_LONG_STREAM)
                      + _prompts_preferring(survivor, replicas, 2, "stream", **_LONG_STREAM))
    plain_prompts = (_prompts_preferring(victim, replicas, 4, "plain", **_LONG_PLAIN)
                     + _prompts_preferring(survivor, replicas, 4, "plain", **_LONG_PLAIN))

    with ThreadPoolExecutor(max_workers=12) as pool:
        started = [threading.Event() for _ in stream_prompts]
        streams = [pool.submit(_stream_outcome, cluster, prompt, event) for prompt, event in zip(stream_prompts, started)]
        plain = [pool.submit(_chat, cluster, prompt, **_LONG_PLAIN) for prompt in plain_prompts]
        for event in started:
            assert event.wait(timeout=60)  # every stream is under way: kill one replica mid-run
        ray.kill(actor, no_restart=True)
        results = [future.result(timeout=180) for future in plain]
        outcomes = [future.result(timeout=180) for future in streams]

    for response in results:  # not streaming: nothing had started, so each was retried if needed
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 200
    assert _retried(cluster) > retried_before  # some of them were in flight on the killed replica
    assert victim in {replica for replica, _ in outcomes}
    for replica, ending in outcomes:  # started streams on the dead replica end with an error event
        assert ending == ("error" if replica == victim else "done"), outcomes

    _wait_running(serve, APP_NAME, replicas=2)
    # Serve reports the replacement running before every handle's router has heard of it (the
    # replica set reaches handles by long poll), so requests go on until it serves one.
    after: set[str] = set()
    deadline = time.monotonic() + 60
    i = 0
    while len(after) < 2 and time.monotonic() < deadline:
        response = _chat(cluster, f"after {i}")
        assert response.status_code == 200, response.text
        after.add(response.headers[REPLICA])
        i += 1
    assert victim not in after and len(after) == 2, (after, i)
