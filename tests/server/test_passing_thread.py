"""The start-up thread hands back its result or its error, and takes its OpenMP workers with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from server.passing_thread import run_in_passing_thread


def test_returns_the_result_from_another_thread():
    caller = threading.get_ident()
    assert run_in_passing_thread(lambda: threading.get_ident()) != caller
    assert run_in_passing_thread(lambda: 41 + 1) == 42


def test_raises_the_work_s_own_exception():
    def fail():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        run_in_passing_thread(fail)


_PROBE = """
import json, os, time
import torch
from server.passing_thread import run_in_passing_thread

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
seen = []

def parallel_work():
    big = torch.ones(2048, 2048)
    (big + big).sum()  # large enough to run on every torch thread
    seen.append(threads())

run_in_passing_thread(parallel_work)
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"before": before, "during": seen[0], "after": threads()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux's /proc and more than one CPU")
def test_the_thread_s_openmp_workers_end_with_it():
    """A parallel region on the passing thread starts an OpenMP team of its own; once the thread
    has ended, the process holds no more threads than before (the engine thread's team stays
    the only new one: see server/passing_thread.py). In a fresh interpreter: this one's torch
    thread settings are whatever earlier tests left."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["during"] >= counts["before"] + 2  # the thread itself and at least one OpenMP worker
    assert counts["after"] <= counts["before"]
