"""BoundedCalls: calls that never return are abandoned with their worker; nothing waits for them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from server.engine.bounded_calls import BoundedCalls, CallTimeout, Watched

BOUND_S = 0.5
SAFETY_S = 60.0  # a hung call returns by then at the latest: without the bound a test fails, not hangs


class Blocker:
    """Calls block until the test ends; records the threads they blocked."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self) -> None:
        self.threads.append(threading.current_thread())
        self.released.wait(SAFETY_S)

    def release(self) -> None:
        """Let the blocked calls return, and their (abandoned) threads end."""
        self.released.set()
        for thread in self.threads:
            thread.join(SAFETY_S)
            assert not thread.is_alive()


@pytest.fixture
def blocker():
    blocking = Blocker()
    yield blocking
    blocking.released.set()


@pytest.fixture
def calls():
    bounded = BoundedCalls(BOUND_S)
    yield bounded
    bounded.shutdown()


def test_calls_run_in_order_on_the_worker(calls):
    ran = []
    keys = calls.run([(i, lambda i=i: ran.append((i, threading.current_thread()))) for i in range(5)])
    assert keys == [] and [i for i, _ in ran] == list(range(5))
    assert all(thread is not threading.current_thread() for _, thread in ran)
    assert calls.abandoned == 0


def test_a_hung_call_is_abandoned_and_the_rest_run_once(calls, blocker):
    ran = []
    batch = [("a", lambda: ran.append("a")), ("hung", blocker), ("b", lambda: ran.append("b")),
             ("c", lambda: ran.append("c"))]
    assert calls.run(batch) == ["hung"]
    assert ran == ["a", "b", "c"] and calls.abandoned == 1
    stuck = blocker.threads[0]
    assert calls.run([("d", lambda: ran.append(threading.current_thread()))]) == []
    assert ran[-1] is not stuck  # a fresh worker
    blocker.release()  # the abandoned worker ends once its call returns: it runs nothing else
    assert ran[:3] == ["a", "b", "c"] and len(ran) == 4


def test_every_hung_call_of_a_batch_is_abandoned(calls, blocker):
    ran = []
    assert calls.run([(1, blocker), (2, lambda: ran.append(2)), (3, blocker)]) == [1, 3]
    assert ran == [2] and calls.abandoned == 2 and len(set(blocker.threads)) == 2
    blocker.release()


def test_started_batch_runs_beside_the_caller(calls, blocker):
    done = threading.Event()
    batch = calls.start([("x", lambda: done.wait(SAFETY_S)), ("hung", blocker)])
    done.set()  # the caller went on while the batch waited
    assert calls.wait(batch) == ["hung"]
    blocker.release()


def test_exceptions_reach_the_caller_after_the_batch(calls):
    ran = []

    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        calls.run([(1, boom), (2, lambda: ran.append(2))])
    assert ran == [2]


def test_call_returns_or_times_out(calls, blocker):
    assert calls.call(lambda: 42) == 42
    with pytest.raises(CallTimeout, match=f"did not return within {BOUND_S:g} s"):
        calls.call(blocker)
    with pytest.raises(KeyError):
        calls.call(lambda: {}["missing"])
    assert calls.call(lambda: "still serving") == "still serving"
    blocker.release()


def test_calls_run_in_the_callers_inference_mode(calls):
    modes = []
    calls.run([(None, lambda: modes.append(torch.is_inference_mode_enabled()))])
    with torch.inference_mode():
        calls.run([(None, lambda: modes.append(torch.is_inference_mode_enabled()))])
    assert modes == [False, True]


class Target:
    def __init__(self, blocker: Blocker | None = None) -> None:
        self.blocker = blocker
        self.calls = 0
        self.value = "plain"

    def work(self) -> int:
        self.calls += 1
        if self.blocker is not None:
            self.blocker()
        return self.calls


def test_watched_calls_are_charged_to_their_own_key(calls, blocker):
    fine, hung, after = Target(), Target(blocker), Target()
    watched = [Watched(fine, "fine"), Watched(hung, "hung"), Watched(after, "after")]
    assert watched[0].value == "plain" and not hasattr(watched[0], "missing")
    assert watched[0].work() == 1  # outside a bounded call: a plain call

    def walk() -> None:  # one call over several keys' objects, as the draft planner makes
        for target in watched:
            target.work()

    assert calls.run([(None, walk)]) == ["hung"]
    assert (fine.calls, hung.calls, after.calls) == (2, 1, 0)
    blocker.release()  # its worker stops at its next watched call: never made
    assert after.calls == 0


def test_unbounded_calls_run_on_the_callers_thread():
    calls = BoundedCalls(0)
    threads = []
    assert not calls.bounded
    assert calls.run([(None, lambda: threads.append(threading.current_thread()))]) == []
    assert calls.call(lambda: 7) == 7
    assert threads == [threading.current_thread()]
    calls.shutdown()


@pytest.mark.parametrize("timeout_s", [BOUND_S, 0])
def test_an_idle_worker_keeps_nothing_its_calls_held(timeout_s):
    """What the last calls held (in the engine: the engine itself and its KV cache) is freed once
    they have run: several engines in one process must not pile up on the device."""
    import gc
    import weakref

    class Held:
        pass

    calls = BoundedCalls(timeout_s)
    held = Held()
    gone = weakref.ref(held)
    batch = calls.start([("row", lambda held=held: None)])
    calls.wait(batch)
    del held, batch
    try:
        for _ in range(100):  # the worker lets go just after it reported the batch done
            gc.collect()
            if gone() is None:
                break
            time.sleep(0.01)
        assert gone() is None
    finally:
        calls.shutdown()
