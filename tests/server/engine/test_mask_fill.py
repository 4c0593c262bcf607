"""MaskFill under the time bound: a hung fill ends its own rows (a batched native fill: its group)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from server.engine.bounded_calls import BoundedCalls
from server.engine.mask_fill import MaskFill

VOCAB = 64
BOUND_S = 0.5
SAFETY_S = 60.0  # a hung call returns by then at the latest: without the bound a test fails, not hangs


class Allow:
    """Allows one token; its fill waits on ``hang`` (an Event) when given one."""

    def __init__(self, token: int, hang: threading.Event | None = None) -> None:
        self.token, self.hang = token, hang

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.hang is not None:
            self.hang.wait(SAFETY_S)
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)


class BatchAllow(Allow):
    """A backend with a batched fill (as xgrammar's and llguidance's)."""

    @classmethod
    def fill_bitmask_batch(cls, matchers, bitmask, rows, threads) -> None:
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)


def seq(matcher) -> SimpleNamespace:
    return SimpleNamespace(matcher=matcher, row=SimpleNamespace(dfa=None))


@pytest.fixture
def hang():
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def masks():
    calls = BoundedCalls(BOUND_S)
    yield MaskFill(VOCAB, torch.device("cpu"), 2, SimpleNamespace(mask_fill_s=0.0), calls)
    calls.shutdown()


def fill(masks: MaskFill, sampled: list) -> tuple[dict[int, set[int] | None], list, list]:
    """{batch row: allowed tokens (None: all)}, the abandoned rows and the failed ones."""
    abandoned, failed = [], []
    bitmask, indices = masks.finish(masks.start(sampled), sampled, lambda s, m: failed.append(s),
                                    lambda s, what: abandoned.append(s))
    allowed = {}
    for words, row in zip(bitmask.tolist(), indices.tolist()):
        bits = {32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1}
        allowed[row] = None if len(bits) == VOCAB else bits
    return allowed, abandoned, failed


def test_a_hung_row_is_abandoned_alone(masks, hang):
    group = [seq(BatchAllow(10 + i)) for i in range(8)]  # 8 rows, 2 threads: one batched call
    stuck = seq(Allow(7, hang))
    sampled = [seq(None), seq(Allow(3)), *group, stuck, seq(Allow(5))]
    allowed, abandoned, failed = fill(masks, sampled)
    assert abandoned == [stuck] and failed == []
    assert allowed[1] == {3} and allowed[11] == {5} and allowed[10] is None  # the stuck row: anything
    assert all(allowed[2 + i] == {10 + i} for i in range(8)) and 0 not in allowed
    # later fills are not held up by the abandoned one
    assert fill(masks, [seq(Allow(9))])[0] == {0: {9}}


def test_a_hang_in_a_batched_fill_abandons_its_group(masks, hang):
    group = [seq(BatchAllow(10 + i, hang if i == 3 else None)) for i in range(8)]
    sampled = [seq(Allow(3)), *group, seq(Allow(5))]
    allowed, abandoned, failed = fill(masks, sampled)
    assert abandoned == group and failed == []  # which row of a native batch hung cannot be told
    assert allowed[0] == {3} and allowed[9] == {5}
    assert all(allowed[1 + i] is None for i in range(8))
