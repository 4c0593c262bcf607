"""Every kind of step once before the first request, so Triton compiles its kernels at start-up.

Triton compiles a kernel per variant: its constexprs (a paged-attention tile of one token or of
several, the key splits) and its specializations (an integer argument equal to 1 or a multiple
of 16, a pointer aligned to 16 bytes). A variant first seen inside a request's step stalls that
step for the compile (0.3-1 s each on an H100's host): measured there, the first jump-forward and
draft steps of a 1B model spent ~2 s compiling attention, and the first masked sampling pass
~0.3 s, which averaged to 48 ms per step over a benchmark row. The decode graphs' capture
compiles what plain decode steps launch; this module runs, on the block manager's scratch block
(which no sequence owns), the mixed steps the engine builds (a one-row continuation, a draft's
per-position logits, decode rows beside a continuation, 16 rows, a whole-block prefill chunk)
and sampling passes over 1, 2, 3 and 16 rows (greedy, sampled, penalised; all rows or some under
a bitmask) through both samplers, with the same runner and sampler objects and the same staging
buffers as a served step.

It runs where kernels compile (CUDA) or where asked to (the Triton interpreter in tests); the
model's linear-layer choices are timed first (:meth:`ModelRunner.prime_linear_choices`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sampler import Sampler, SamplingParams
from server.engine.block_manager import NULL_BLOCK
from server.engine.mask_fill import MaskFill
from server.engine.step_batch import StepBatch

log = logging.getLogger("trellis.engine")

# (new tokens per row, per-position logits): the mixed steps' shapes
MIXED_STEPS: tuple[tuple[tuple[int, ...], bool], ...] = (
    ((5,), False),  # a jump-forward continuation
    ((5,), True),  # a draft's verification (logits at every position)
    ((1, 4), False),  # a decode row beside a continuation
    ((1,) * 15 + (3,), False),  # 16 rows
    ((16,), False),  # a prefill chunk of a whole block
)
SAMPLED_ROWS = (1, 2, 3, 16)


@dataclass(frozen=True)
class WarmupTarget:
    """What a served step runs through: the engine's runner (graphed or not), its eager sampler
    and mask fill, and its limits."""

    runner: Any
    sampler: Sampler
    masks: MaskFill
    max_batch_size: int
    max_model_len: int


def warm_up_kernels(target: WarmupTarget) -> float:
    """Run each mixed step and masked sampling pass once (see the module docstring); returns
    the seconds it took. A failure is logged, not raised: the kernels then compile on first use."""
    started = time.perf_counter()
    runner = target.runner
    try:
        with torch.inference_mode():
            _run_all(target)
    except Exception:  # noqa: BLE001 (start-up goes on: slower first steps, not a dead server)
        log.exception("kernel warm-up failed; kernels compile on first use")
    finally:
        _clear_scratch_block(runner)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    log.info("kernels warmed up for mixed steps and masked sampling in %.1f s", seconds)
    return seconds


def _run_all(target: WarmupTarget) -> None:
    runner = target.runner
    prime = getattr(getattr(runner, "runner", runner), "prime_linear_choices", None)
    if prime is not None:
        prime()
    for counts, per_position in MIXED_STEPS:
        if len(counts) <= target.max_batch_size and max(counts) <= target.max_model_len:
            runner.forward(_scratch_batch(counts, per_position, runner.block_size, runner.device))
    for rows in (r for r in SAMPLED_ROWS if r <= target.max_batch_size):
        for params in _row_params(rows):
            for masked in ([list(range(rows)), list(range(1, rows))] if rows > 1 else [[0]]):
                _sampling_pass(target, params, masked)


def _scratch_batch(counts: tuple[int, ...], per_position: bool, block_size: int,
                   device: torch.device) -> StepBatch:
    """Rows of token 0 from position 0, their keys and values written to the scratch block."""
    rows = [([NULL_BLOCK] * -(-count // block_size), [0] * count, 0) for count in counts]
    return StepBatch.build(rows, block_size, device, logit_counts=list(counts) if per_position else None)


def _row_params(rows: int) -> list[list[SamplingParams]]:
    """Greedy rows; penalised rows sampled at a temperature (the penalty kernel fuses it) and
    greedy (it does not); penalties on a subset of the rows."""
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, seed=0, repetition_penalty=1.1, presence_penalty=0.1)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    passes = [[greedy] * rows, [sampled] * rows, [penalised] * rows]
    if rows > 1:
        passes.append([sampled] + [greedy] * (rows - 1))
    return passes


def _sampling_pass(target: WarmupTarget, params: list[SamplingParams], masked: list[int]) -> None:
    """One pass of each sampler (the in-graph one where it takes the rows, then the eager one)
    over zero logits, the ``masked`` rows under an all-allowing bitmask staged as the mask fill
    stages its own."""
    sampler, runner = target.sampler, target.runner
    rows = [sampler.new_row(p, [0]) for p in params]
    try:
        graph_sampler = getattr(runner, "graph_sampler", None)
        for run in filter(None, (graph_sampler, sampler)):
            logits = torch.zeros(len(rows), runner.vocab_size, dtype=torch.float32, device=runner.device)
            bitmask, indices = target.masks.stage_allowing_all(masked)
            pending = run.sample_async(logits, rows, bitmask, indices)
            if pending is not None:
                pending.result_now()
    finally:
        for row in rows:
            row.release()


def _clear_scratch_block(runner) -> None:
    """The scratch block back to zeros, as the cache was allocated (nothing reads what the warm-up
    wrote there, but a clean block keeps "padding writes nothing" checkable)."""
    kv = getattr(runner, "kv", None)
    if kv is not None:
        kv.k[:, NULL_BLOCK].zero_()
        kv.v[:, NULL_BLOCK].zero_()

