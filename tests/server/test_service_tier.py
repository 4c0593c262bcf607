"""``service_tier``: validated, echoed, and honoured by admission (priority first, flex yields)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from sampler import SamplingParams
from server.config import Settings
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest
from server.model_loader import ModelSource
from tests.conftest import start_server


def test_priority_overtakes_waiting_flex_and_default_in_the_engine(tiny_model_dir, default_tokenizer):
    runner = ModelRunner.for_sequences(load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu")), 1, 256)
    engine = Engine(runner, default_tokenizer, max_batch_size=1, max_model_len=256)
    finished: list[str] = []

    def submit(name: str, tier: str) -> None:
        def sink(delta):
            if delta.finish_reason:
                finished.append(name)

        engine.submit(GenerationRequest(request_id=name, prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0.0),
                                        max_tokens=3, ignore_eos=True, sink=sink, service_tier=tier))

    submit("running", "default")
    engine.step()  # "running" holds the only slot
    for name, tier in [("flex1", "flex"), ("flex2", "flex"), ("default1", "default"), ("flex3", "flex"),
                       ("auto1", "auto"), ("priority1", "priority")]:
        submit(name, tier)
    while len(finished) < 7:
        engine.step()
    assert finished == ["running", "priority1", "default1", "auto1", "flex1", "flex2", "flex3"]


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_batch_size=1, max_model_len=4096)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name="tiny"))
    yield running
    stop()


def _wait_until(condition) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the engine never reached the expected state"
        time.sleep(0.01)


def test_priority_request_overtakes_queued_flex_requests(one_slot_server):
    engine = one_slot_server.state.engine
    base = one_slot_server.base_url
    order: list[str] = []
    lock = threading.Lock()

    def request(name: str, tier: str) -> None:
        # replies are ordered by arrival: the flex requests run long enough that the priority one's
        # reply cannot arrive after the next request's, however the client threads are scheduled
        tokens = 4 if tier == "priority" else 32
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": tokens, "ignore_eos": True, "service_tier": tier}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert reply["service_tier"] == tier
        with lock:
            order.append(name)

    # A blocker holds the only slot until we close its stream (an abort: no timing involved).
    blocker_body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=blocker_body, timeout=120) as blocker:
        lines = blocker.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        threads = []
        for i in range(3):
            threads.append(threading.Thread(target=request, args=(f"flex{i}", "flex")))
            threads[-1].start()
            _wait_until(lambda: engine.num_waiting == i + 1)
        threads.append(threading.Thread(target=request, args=("priority", "priority")))
        threads[-1].start()
        _wait_until(lambda: engine.num_waiting == 4)
    for thread in threads:
        thread.join(timeout=120)
    assert order == ["priority", "flex0", "flex1", "flex2"]


def test_service_tier_is_validated_and_echoed(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError, match="service_tier") as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_body={"service_tier": "scale"})
    assert info.value.body["param"] == "service_tier"
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           service_tier="auto")
    assert reply.service_tier == "default"
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           service_tier="flex")
    assert reply.service_tier == "flex"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                            service_tier="priority", stream=True)
    assert {chunk.service_tier for chunk in stream} == {"priority"}
    plain = httpx.post(tiny_server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                       timeout=60).json()
    assert "service_tier" not in plain
