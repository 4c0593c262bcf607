"""Test-only worker functions (run inside compile workers via ConstraintCompiler.PLAN_JOB).

A choice spec whose first option is ``"sleep:S"`` sleeps S seconds, ``"hog:MB"`` allocates MB
MiB; anything else is planned as usual.
"""

from __future__ import annotations

import time

from constraints.compile import jobs


def plan(spec):
    first = spec.source[0] if spec.kind == "choice" else ""
    if first.startswith("sleep:"):
        time.sleep(float(first.split(":")[1]))
    elif first.startswith("hog:"):
        held = [bytearray(1 << 20) for _ in range(int(first.split(":")[1]))]
        del held
    return jobs.plan(spec)


def slow_init(seconds: float) -> None:
    """A worker init that takes ``seconds`` (for WorkerPool.wait_ready)."""
    time.sleep(seconds)


def echo(value):
    return value
