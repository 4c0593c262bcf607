"""The scheduler's prompt cuts for a batch-invariant (quantized) runner: at block boundaries."""

from __future__ import annotations

from server.engine.block_manager import BlockManager
from server.engine.scheduler import Scheduler


def test_a_cut_prompt_ends_at_a_block_boundary() -> None:
    scheduler = Scheduler(BlockManager(16, 4), max_batch_size=4, prefill_budget=6, chunk_multiple=4)
    assert scheduler._aligned_cut(0, 6, must_progress=False) == 4
    assert scheduler._aligned_cut(3, 10, must_progress=False) == 9  # 3 + 9 = 12 cached
    assert scheduler._aligned_cut(4, 3, must_progress=False) == 0  # no boundary within reach: wait
    assert scheduler._aligned_cut(4, 3, must_progress=True) == 4  # alone in the step: the next one
    assert Scheduler(BlockManager(16, 4), 4, 6).chunk_multiple == 1  # unquantized: any cut
