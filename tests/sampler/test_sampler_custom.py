"""Client logit processors (SGLang's contract) inside the batched sampler pass."""

from __future__ import annotations

import json
import threading

import dill
import pytest
import torch

from sampler import Sampler, SamplingParams
from sampler.custom import CustomProcessorError, load_custom_processor

V = 50


class ForceToken:
    """Forces each row's ``custom_params["token_id"]``; records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def __call__(self, logits, custom_param_list=None):
        self.calls.append(custom_param_list)
        for i, params in enumerate(custom_param_list):
            if params.get("explode"):
                raise RuntimeError("boom")
            if params.get("nan"):
                logits[i] = float("nan")
                continue
            logits[i, :] = -float("inf")
            logits[i, params["token_id"]] = 0.0
        return logits


def rows_for(sampler: Sampler, params: list[SamplingParams]):
    return [sampler.new_row(p, [1, 2, 3]) for p in params]


def test_processor_forces_only_its_rows_in_one_call(device):
    sampler, proc = Sampler(V, device), ForceToken()
    params = [
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"token_id": 7}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1, custom_processor=proc, custom_params={"token_id": 9}),
    ]
    logits = torch.zeros(3, V, device=device)
    logits[:, 4] = 10.0
    result = sampler.sample(logits, rows_for(sampler, params))
    assert result.token_ids == [7, 4, 9] and result.failures == {}
    assert len(proc.calls) == 1 and [p["token_id"] for p in proc.calls[0]] == [7, 9]
    assert proc.calls[0][0]["__req__"].origin_input_ids == [1, 2, 3]


def test_failing_rows_fail_alone(device):
    sampler, proc = Sampler(V, device), ForceToken()
    params = [
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"token_id": 7}),
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"explode": True}),
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"nan": True}),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.zeros(4, V, device=device)
    logits[:, 4] = 10.0
    result = sampler.sample(logits, rows_for(sampler, params))
    assert result.token_ids[0] == 7 and result.token_ids[3] == 4
    assert set(result.failures) == {1, 2}
    assert "RuntimeError: boom" in result.failures[1] and "NaN" in result.failures[2]


def test_wrong_shape_fails_its_row(device):
    sampler = Sampler(V, device)
    params = [SamplingParams(temperature=0.0, custom_processor=lambda logits, _: logits[:, :3])]
    result = sampler.sample(torch.zeros(1, V, device=device), rows_for(sampler, params))
    assert "shape" in result.failures[0]


def test_load_follows_sglang_wire_format():
    payload = json.dumps({"callable": dill.dumps(ForceToken).hex()})
    processor = load_custom_processor(payload)
    assert isinstance(processor, ForceToken) and load_custom_processor(payload) is processor
    for bad in ("not json", json.dumps({"callable": "zz"}), json.dumps({"x": 1}),
                json.dumps({"callable": dill.dumps(3).hex()})):
        with pytest.raises(CustomProcessorError):
            load_custom_processor(bad)


SAFETY_S = 60.0  # a hung call returns by then at the latest: without the bound the test fails, not hangs


def bounded(timeout_s: float):
    """A processor runner as the engine's: the call on a thread of its own, abandoned after
    ``timeout_s`` (the test's stand-in for ``BoundedCalls.call``)."""

    def run(fn):
        out = []
        thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not out:
            raise TimeoutError(f"the call did not return within {timeout_s:g} s")
        return out[0]

    return run


class HangOrForce(ForceToken):
    """Forces ``token_id``; hangs (until released) when a row asks it to, raises TimeoutError of
    its own when one asks for that."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def __call__(self, logits, custom_param_list=None):
        if any(params.get("hang") for params in custom_param_list):
            self.released.wait(SAFETY_S)
        if any(params.get("own_timeout") for params in custom_param_list):
            raise TimeoutError("my own")
        return super().__call__(logits, custom_param_list)


def test_processor_over_the_bound_fails_only_its_row(device):
    proc = HangOrForce()
    sampler = Sampler(V, device, run_processor=bounded(0.5))
    params = [
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"hang": True}),
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"token_id": 7}),
        SamplingParams(temperature=0.0, custom_processor=proc, custom_params={"own_timeout": True}),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.zeros(4, V, device=device)
    logits[:, 4] = 10.0
    try:
        result = sampler.sample(logits, rows_for(sampler, params))
    finally:
        proc.released.set()
    assert result.failures[0] == "custom_logit_processor timed out: the call did not return within 0.5 s"
    assert result.failures[2] == "custom_logit_processor raised TimeoutError: my own"  # its own, not the bound
    assert set(result.failures) == {0, 2}
    assert result.token_ids[1] == 7 and result.token_ids[3] == 4
