"""Run start-up work on a thread that ends with it, so its OpenMP workers end too.

torch's CPU kernels run their parallel regions on the calling thread's own OpenMP team (libgomp
keeps one pool of workers per thread that has opened a parallel region, for as long as that
thread lives). Once the process holds more pooled workers than the machine has cores, libgomp
stops spinning between regions and every region of every team pays a futex wake-up instead:
measured on a 2-core machine, an elementwise op went from 6 to 70 µs and a decode step of the
default model from 28 to 43 ms when the model was loaded on one thread and decoded on another.
Loading on a thread that exits frees its pool, which leaves the engine thread's team the only
one: the served step then costs what the benchmarks that step the engine in place measure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_passing_thread(work: Callable[[], T], name: str = "trellis-load") -> T:
    """``work()`` on a fresh thread, joined; returns its result or raises its exception."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
