"""A matcher's per-token calls start no thread team of their own.

The engine makes these calls on its bounded-call worker, beside the forward. A torch op large
enough to run in parallel there starts an OpenMP team for that thread; with more team threads
than cores, every team (the forward's too) then waits by sleeping instead of spinning, which
cost the CPU decode loop a third of its speed once (measured with benchmarks/decode.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from constraints import ConstraintSpec
from tests.constraints.conftest import new_mask

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")

SPECS = {
    "regex": ConstraintSpec("regex", "ab|ac"),
    "json_schema": ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"], "additionalProperties": False}),
    "choice": ConstraintSpec("choice", ["yes", "no"]),
}


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_started_by(fn) -> int:
    """How many OS threads ``fn`` leaves behind when run on a fresh thread (counted while that
    thread is still alive: a team's threads live as long as the thread that started it)."""
    result: dict[str, int] = {}

    def run() -> None:
        time.sleep(0.2)  # threads of an earlier probe's team end once their thread has
        before = _os_threads()
        fn()
        result["started"] = _os_threads() - before

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result["started"]


def _walk_to_the_end(matcher, tok) -> None:
    """The calls the engine makes per token, until only a stop token is allowed."""
    while True:
        mask = new_mask()
        matcher.fill_bitmask(mask, 0)
        forced = matcher.forced_tokens()
        if not forced:
            return
        assert matcher.accept_forced(forced) == len(forced)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_matcher_calls_start_no_thread_team(compiler, tok, kind):
    matcher = compiler.compile(SPECS[kind]).new_matcher()
    first = {"regex": "a", "json_schema": '{"a": 1', "choice": "y"}[kind]
    for token in tok.encode(first, add_special_tokens=False):
        assert matcher.accept_token(token)
    assert _threads_started_by(lambda: _walk_to_the_end(matcher, tok)) == 0


def test_the_probe_sees_a_team():
    """The probe can fail: a torch op over a vocabulary's bits does start a team."""
    import torch

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no team to start")
    bits = torch.zeros(49152, dtype=torch.int32)
    assert _threads_started_by(lambda: torch.nonzero((bits >> 3) & 1)) > 0
