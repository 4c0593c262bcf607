"""--max-queue-wait through the real app: a flood behind a full batch gets fast 429s with a
Retry-After and the project's error body (before rendering or compiling); 0 refuses nothing."""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import httpx
import pytest

from server.config import add_serve_arguments, settings_from_args
from tests.server.hostile_util import assert_error, assert_retry_after

FLOOD = 6


@pytest.fixture
def tight_server(tiny_server):
    """The shared tiny server; :func:`tighten` sets a limit anything behind a full batch is over."""
    yield tiny_server
    wait_idle(tiny_server)


def tighten(server, monkeypatch, limit: float = 0.001) -> None:
    monkeypatch.setattr(server.state.queue_wait, "limit_s", limit)


class Blocker:
    """Streamed requests holding every batch slot until closed (an abort: no timing)."""

    def __init__(self, server) -> None:
        self.server = server
        self.release = threading.Event()
        self.slots = server.state.engine.max_batch_size
        self.threads = [threading.Thread(target=self._hold) for _ in range(self.slots)]

    def _hold(self) -> None:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.server.base_url + "/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                if self.release.is_set():
                    return

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 60
        while self.server.state.engine.num_running < self.slots:
            assert time.monotonic() < deadline, "the blockers never all ran"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join(timeout=60)


def _flood(server, bodies: list[dict]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: httpx.post(server.base_url + "/v1/chat/completions", json=body,
                                                      timeout=120), bodies))


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def _metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_flood_behind_a_full_batch_gets_429_with_retry_after(tight_server, monkeypatch):
    # a broken schema and a template that cannot render would be 400s: refused before either runs
    bodies = [_chat() for _ in range(FLOOD - 3)] + [
        _chat(service_tier="priority"),
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        _chat(chat_template="{% for %}"),
    ]
    with Blocker(tight_server):
        tighten(tight_server, monkeypatch)
        responses = _flood(tight_server, bodies)
        assert _metric(tight_server, "trellis_expected_queue_wait_seconds") > 0.001
    for response in responses:
        error = assert_error(response, 429, code="queue_wait_exceeded")
        assert error["type"] == "rate_limit_error", error
        assert "expected wait for a first token" in error["message"] and "limit of" in error["message"], error
        assert assert_retry_after(response) >= 1
    assert _metric(tight_server, 'trellis_rejected_requests_total{reason="queue_wait"}') >= FLOOD
    # with the slot free again the server takes requests
    reply = httpx.post(tight_server.base_url + "/v1/chat/completions", json=_chat(), timeout=120)
    assert reply.status_code == 200, reply.text


def test_invalid_service_tier_is_still_a_400(tight_server, monkeypatch):
    tighten(tight_server, monkeypatch)
    reply = httpx.post(tight_server.base_url + "/v1/chat/completions", json=_chat(service_tier="gold"), timeout=120)
    assert_error(reply, 400, param="service_tier")


def test_flag_and_its_environment_variable(monkeypatch):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert settings_from_args(parser.parse_args([])).max_queue_wait == 20.0
    assert settings_from_args(parser.parse_args(["--max-queue-wait", "0"])).max_queue_wait == 0.0
    monkeypatch.setenv("TRELLIS_MAX_QUEUE_WAIT", "7.5")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert settings_from_args(parser.parse_args([])).max_queue_wait == 7.5


def test_zero_limit_refuses_nothing(tight_server, monkeypatch):
    tighten(tight_server, monkeypatch, 0.0)  # as --max-queue-wait 0 builds it
    with ThreadPoolExecutor(FLOOD) as pool:
        with Blocker(tight_server):
            futures = [pool.submit(httpx.post, tight_server.base_url + "/v1/chat/completions", json=_chat(),
                                   timeout=120) for _ in range(FLOOD)]
            deadline = time.monotonic() + 60
            while tight_server.state.engine.num_waiting < FLOOD:  # all queued behind the blocker
                assert time.monotonic() < deadline, "the flood never queued"
                assert not any(f.done() for f in futures), [f.result().text for f in futures if f.done()]
                time.sleep(0.01)
        assert [f.result().status_code for f in futures] == [200] * FLOOD


def wait_idle(server) -> None:
    """The shared server back to an empty batch and queue for the tests after these."""
    deadline = time.monotonic() + 60
    while server.state.engine.num_running or server.state.engine.num_waiting:
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.01)
