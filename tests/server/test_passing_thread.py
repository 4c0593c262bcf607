"""The start-up thread hands back its result or its error, and takes its OpenMP workers with it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from server.passing_thread import run_in_passing_thread


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_returns_the_result_from_another_thread():
    caller = threading.get_ident()
    assert run_in_passing_thread(lambda: threading.get_ident()) != caller
    assert run_in_passing_thread(lambda: 41 + 1) == 42


def test_raises_the_work_s_own_exception():
    def fail():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        run_in_passing_thread(fail)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux's /proc and a torch with more than one CPU thread")
def test_the_thread_s_openmp_workers_end_with_it():
    """A parallel region on the passing thread starts an OpenMP team of its own; once the thread
    has ended, the process holds no more threads than before (the engine thread's team stays
    the only new one: see server/passing_thread.py)."""
    before = _os_threads()
    seen: list[int] = []

    def parallel_work() -> None:
        big = torch.ones(2048, 2048)
        (big + big).sum()  # large enough to run on every torch thread
        seen.append(_os_threads())

    run_in_passing_thread(parallel_work)
    assert seen[0] >= before + 2  # the thread itself and at least one OpenMP worker
    deadline = time.monotonic() + 10
    while _os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _os_threads() <= before
