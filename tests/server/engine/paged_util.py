"""Drive a paged ModelRunner directly: a fixed run of blocks per "slot" (no block manager)."""

from __future__ import annotations

import torch

from server.engine.step_batch import StepBatch


def slot_table(runner, slot: int, max_len: int = 64) -> list[int]:
    """Blocks 1 + slot * n ... for a cache built by ``ModelRunner.for_sequences(hf, seqs, max_len)``."""
    per_seq = -(-max_len // runner.block_size)
    return [1 + slot * per_seq + i for i in range(per_seq)]


def step(runner, rows, max_len: int = 64, **kwargs) -> torch.Tensor:
    """``rows`` as (slot, new tokens, start): one forward, logits as ``runner.forward``."""
    paged = [(slot_table(runner, slot, max_len), list(new), start) for slot, new, start in rows]
    return runner.forward(StepBatch.build(paged, runner.block_size, runner.device, **kwargs))


def extend(runner, slot: int, tokens: list[int], start: int, max_len: int = 64) -> torch.Tensor:
    """Append ``tokens`` to ``slot`` whose cache holds ``start`` tokens; logits [V] at the last."""
    return step(runner, [(slot, tokens, start)], max_len)[0]
