"""AdmissionControl on its own: all-or-nothing reservations and the retry_after estimate."""

from __future__ import annotations

import pytest

from server.engine import admission
from server.engine.admission import AdmissionControl
from server.engine.errors import EngineDead, EngineOverloaded, EngineUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(admission.time, "monotonic", clock)
    return clock


def test_reserve_counts_and_enqueues_or_does_neither():
    control = AdmissionControl(max_seqs=3, max_tokens=100)
    queued = []
    control.reserve([10, 20], lambda: queued.append("first"))
    assert (control.waiting_seqs, control.waiting_tokens, queued) == (2, 30, ["first"])
    with pytest.raises(EngineOverloaded):
        control.reserve([1, 1], lambda: queued.append("second"))
    with pytest.raises(EngineOverloaded):
        control.reserve([71], lambda: queued.append("third"))
    assert (control.waiting_seqs, control.waiting_tokens, queued) == (2, 30, ["first"])
    control.reserve([70], lambda: queued.append("fits"))
    assert (control.waiting_seqs, control.waiting_tokens) == (3, 100)
    control.admitted([10, 20])
    control.dropped(70)
    assert (control.waiting_seqs, control.waiting_tokens) == (0, 0)


def test_oversized_request_is_taken_when_nothing_waits():
    control = AdmissionControl(max_seqs=2, max_tokens=10)
    control.reserve([50, 50, 50], lambda: None)
    assert control.waiting_seqs == 3
    with pytest.raises(EngineOverloaded):
        control.reserve([1], lambda: None)


def test_retry_after_from_admission_rate(clock):
    control = AdmissionControl(max_seqs=4, max_tokens=10_000)
    for _ in range(10):  # one sequence of 100 tokens admitted per second
        control.admitted([100])
        clock.now += 1.0
    control.reserve([1] * 4, lambda: None)
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([1] * 5, lambda: None)  # 5 over at 1 seq/s
    assert refused.value.retry_after == 5
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([1], lambda: None)
    assert refused.value.retry_after == 1


def test_retry_after_when_tokens_are_the_limit(clock):
    control = AdmissionControl(max_seqs=100, max_tokens=1000)
    for _ in range(10):  # 50 tokens per second
        control.admitted([50])
        clock.now += 1.0
    control.reserve([1000], lambda: None)
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([500], lambda: None)
    assert refused.value.retry_after == 10


def test_retry_after_without_history_and_its_cap(clock):
    control = AdmissionControl(max_seqs=1, max_tokens=10)
    control.reserve([1], lambda: None)
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([1], lambda: None)
    assert refused.value.retry_after == 1
    control.admitted([1])
    clock.now += 1000.0  # the only admission is out of the window
    control.reserve([1], lambda: None)
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([1], lambda: None)
    assert refused.value.retry_after == 1
    control.admitted([1])
    clock.now += 59.0  # one sequence a minute; 1000 over
    control.reserve([1], lambda: None)
    with pytest.raises(EngineOverloaded) as refused:
        control.reserve([1] * 1000, lambda: None)
    assert refused.value.retry_after == admission.MAX_RETRY_AFTER_S


def test_closed_control_refuses_everything():
    control = AdmissionControl(max_seqs=10, max_tokens=100)
    control.reserve([5], lambda: None)
    control.close("engine shut down")
    assert control.waiting_seqs == control.waiting_tokens == 0
    with pytest.raises(EngineDead, match="engine shut down") as refused:
        control.reserve([1], lambda: None)
    assert isinstance(refused.value, EngineUnavailable)
