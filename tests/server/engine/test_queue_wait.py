"""The expected-wait estimate (given rates, no clock) and the admission by it (a fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.engine import admission as admission_module
from server.engine import queue_wait
from server.engine.admission import AdmissionControl, QueueWaitExceeded, WaitAdmission
from server.engine.queue_wait import QueueWait


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def given_rates() -> QueueWait:
    """A full batch frees a slot every second (10 tokens at 10 tokens/s); a mean prompt (100
    tokens at 1000 tokens/s) takes 0.1 s; so each sequence ahead adds 1.1 s."""
    return QueueWait(prefill_rate=1000.0, decode_rate=10.0, output_tokens=10.0, prompt_tokens=100.0,
                     step_seconds=0.0)


def test_estimate_from_the_queue_and_the_rates():
    rates = given_rates()
    # a free slot: only the prompt tokens ahead and its own
    assert rates.estimate(0, 0, running=1, batch_size=2, own_tokens=50) == pytest.approx(0.05)
    assert rates.estimate(1, 300, running=0, batch_size=2, own_tokens=100) == pytest.approx(0.4)
    # full batch: 3 ahead + itself need 4 slots to free
    assert rates.estimate(3, 300, running=2, batch_size=2, own_tokens=100) == pytest.approx(4.4)
    assert rates.estimate(3, 300, running=2, batch_size=2) == pytest.approx(4.4)  # the mean prompt
    assert rates.per_sequence(batch_full=True) == pytest.approx(1.1)
    assert rates.per_sequence(batch_full=False) == pytest.approx(0.1)


def test_rates_are_measured_moving_means():
    rates = QueueWait(prefill_rate=1.0, decode_rate=1.0, output_tokens=1.0, step_seconds=9.0)
    rates.observe_step(0.5, 0, 50)  # a pure decode step: 100 tokens/s (replaces the prior)
    assert rates.decode_rate == pytest.approx(100.0)
    rates.observe_step(1.0, 0, 200)  # tokens and seconds are weighted apart: (50 + 15) / (0.5 + 0.05)
    assert rates.decode_rate == pytest.approx((50 + 0.1 * 150) / (0.5 + 0.1 * 0.5))
    # a mixed step of 1 s: 13 decode rows at 130 tokens/s took 0.1 s, 450 prompt tokens the rest
    rates = QueueWait(decode_rate=1.0)
    rates.observe_step(1.0, 0, 130)
    rates.observe_step(1.0, 450, 13)
    assert rates.prefill_rate == pytest.approx(500.0)
    # a step feeding 3 forced tokens in its overhead weighs 3 tokens, not a whole step's rate
    rates.observe_step(0.25, 3, 13)
    assert rates.prefill_rate == pytest.approx((450 + 0.1 * (3 - 450)) / (0.9 + 0.1 * (0.15 - 0.9)))
    rates.observe_step(0.0, 1000, 0)  # no time: no sample
    rates.observe_step(1.0, 0, 0)  # nothing fed (idle): no sample
    assert rates.prefill_rate == pytest.approx((450 + 0.1 * (3 - 450)) / (0.9 + 0.1 * (0.15 - 0.9)))
    rates.observe_finished(40)
    rates.observe_finished(0)  # a sequence that left at once still held its slot
    assert rates.output_tokens == pytest.approx(40 + queue_wait.ALPHA * (1 - 40))
    rates.observe_admitted(30)
    assert rates.prompt_tokens == pytest.approx(30.0)


def test_admission_control_feeds_the_rates_from_engine_totals():
    control = AdmissionControl(max_seqs=10, max_tokens=1000)
    control.stepped(1.0, SimpleNamespace(extend_tokens=0, decode_tokens=20))
    control.stepped(0.5, SimpleNamespace(extend_tokens=0, decode_tokens=30))  # 10 more in 0.5 s
    assert control.rates.decode_rate == pytest.approx(20.0)
    control.admitted([64, 64])
    control.finished(7)
    assert (control.rates.prompt_tokens, control.rates.output_tokens) == (64.0, 7.0)


def gate(limit: float, *, waiting: int = 0, running: int = 2, batch_size: int = 2) -> tuple[WaitAdmission, Clock]:
    control = AdmissionControl(max_seqs=1000, max_tokens=1_000_000)
    control.rates = given_rates()
    for _ in range(waiting):
        control.reserve([100], lambda: None)
    clock = Clock()
    return WaitAdmission(control, limit, batch_size, lambda: running, clock), clock


def refused(admission: WaitAdmission, tier: str | None = None) -> QueueWaitExceeded:
    with pytest.raises(QueueWaitExceeded) as refusal:
        admission.enter(tier)
    return refusal.value


def test_over_the_limit_is_refused_with_the_time_until_it_would_fit():
    admission, _ = gate(3.0, waiting=1)
    assert admission.expected_wait() == pytest.approx(2.2)
    admission.enter(None)  # 2.2 s: in, and now counted ahead of the next
    assert admission.pending == 1
    refusal = refused(admission)
    assert (refusal.estimate, refusal.limit) == (pytest.approx(3.3), 3.0)
    assert refusal.retry_after == 1  # 0.3 s over, in whole seconds
    assert "3.3 s" in str(refusal) and "limit of 3 s" in str(refusal)
    assert admission.pending == 1  # a refusal holds no place


def test_tickets_hold_a_place_until_released():
    admission, _ = gate(3.0, waiting=1)
    ticket = admission.enter(None)
    refused(admission)
    ticket.release()
    ticket.release()  # once only
    assert admission.pending == 0
    admission.enter(None)


def test_service_tiers_scale_the_limit():
    admission, _ = gate(2.0, waiting=1)  # 2.2 s expected
    refused(admission, "default")
    refused(admission, "auto")
    assert refused(admission, "flex").limit == 1.0
    admission.enter("priority")  # may wait 4 s
    admission, _ = gate(2.0)  # 1.1 s expected
    refused(admission, "flex")
    admission.enter("default")


def test_idle_server_takes_a_request_whatever_its_estimate():
    admission, _ = gate(0.001, running=0)  # a free slot, nothing waiting: 0.1 s of its own prefill
    admission.enter(None)
    refused(admission)  # the next one waits behind it


def test_zero_limit_never_refuses():
    admission, _ = gate(0.0, waiting=50)
    for _ in range(10):
        admission.enter("flex")
    assert admission.pending == 0


def test_refused_requests_are_told_to_return_in_turn():
    admission, _ = gate(3.0, waiting=1)
    admission.enter(None)
    # 0.3 s over the limit; then each one 1.1 s (one sequence) after the one before
    assert [refused(admission).retry_after for _ in range(3)] == [1, 3, 5]


def test_a_return_keeps_its_place_from_newcomers():
    admission, clock = gate(2.5, waiting=1)
    ticket = admission.enter(None)  # 2.2 s
    assert refused(admission).retry_after == 1  # 3.3 s: to return at t+1
    ticket.release()  # submitted: the engine's queue holds it; the one before went into the batch
    admission.control.reserve([100], lambda: None)
    admission.control.admitted([100])
    clock.now += 0.4
    # 2.2 s would fit, but the return due in 0.6 s would then wait 3.3 - 0.6 = 2.7 s: sent behind it
    assert admission.expected_wait() == pytest.approx(2.2)
    assert refused(admission).retry_after == 2
    clock.now += 0.6  # the return comes: it takes its place, the newcomer's return is next
    admission.enter(None)


def test_a_return_not_taken_up_is_forgotten():
    admission, clock = gate(2.5, waiting=1)
    admission.enter(None)
    refused(admission)  # return at t+1
    admission._pending = 0
    clock.now += 1.0 + 2.5  # past its grace: whoever comes is not held back for it
    admission.enter(None)
    admission, clock = gate(2.5, waiting=1)
    admission.enter(None)
    refused(admission)
    admission._pending = 0
    clock.now += 0.3  # still due: held back
    refused(admission)


def test_retry_after_may_be_minutes_but_is_capped():
    admission, _ = gate(1.0, waiting=200)
    assert refused(admission).retry_after == 221  # 201 x 1.1 s, 1 s of it allowed
    admission, _ = gate(1.0, waiting=400)
    assert refused(admission).retry_after == admission_module.MAX_RETURN_S
    assert not admission._returns  # not booked


def test_returns_are_forgotten_when_the_server_goes_idle():
    running = [2]
    control = AdmissionControl(max_seqs=1000, max_tokens=1_000_000)
    control.rates = given_rates()
    control.reserve([100], lambda: None)
    clock = Clock()
    admission = WaitAdmission(control, 2.5, 2, lambda: running[0], clock)
    admission.enter(None).release()  # 2.2 s
    admission.enter(None)
    refused(admission)  # 3.3 s: a return booked for t+1 (as in the test above)
    admission._pending = 0
    control.admitted([100])
    running[0] = 0
    admission.enter(None).release()  # idle: no queue to keep a place in
    running[0] = 2
    control.reserve([100], lambda: None)
    clock.now += 0.4
    admission.enter(None)  # 2.2 s, and no return held for


def test_a_return_may_wait_a_little_over_the_limit():
    admission, clock = gate(3.0, waiting=1)
    admission.enter(None)
    assert refused(admission).retry_after == 1  # 3.3 s now: to return at t+1
    clock.now += 1.0  # the queue has not moved: still 3.3 s, within 1.25 x 3 for the return only
    admission.enter(None)
    refused(admission)  # 4.4 s
