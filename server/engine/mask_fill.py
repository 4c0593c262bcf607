"""The step's constraint bitmasks, filled on the mask thread into a staging buffer.

Rows whose constraint is followed on the host (a matcher, not a device-resident DFA) get their
bitmask filled by the backends' batched, parallel fills (:func:`constraints.backends.batch_fill.fill_bitmasks`)
on one mask thread, while the engine thread goes on; the row indices and the bitmasks travel to
the device in one non-blocking copy from a pinned, reused buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from constraints.backends.batch_fill import fill_bitmasks
from server.engine.host_buffers import HostStaging
from server.engine.sequence import Sequence

log = logging.getLogger("trellis.engine")

Fill = tuple[Future, list[int]]  # the fill, and the batch rows it masks


class MaskFill:
    """Fills bitmasks [M, ceil(V/32)] int32 for the host-masked rows of a sampler pass."""

    def __init__(self, vocab_size: int, device: torch.device, threads: int, stats) -> None:
        self.threads = threads
        self.stats = stats
        self.last_fill_s = 0.0  # how long the last fill took on the mask thread
        self.words = (vocab_size + 31) // 32
        self._valid_bits = _valid_bits(vocab_size, self.words)
        self._staging = HostStaging(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-mask")

    def start(self, sampled: list[Sequence]) -> Fill | None:
        """Start filling the masks of the rows of ``sampled`` whose mask the host computes, into
        a staging buffer: the row indices [M] int64, then the bitmask [M, W] int32."""
        rows = [i for i, seq in enumerate(sampled) if needs_host_mask(seq)]
        if not rows:
            return None
        host = self._staging.buffer(8 * len(rows) + 4 * len(rows) * self.words)
        host[: 8 * len(rows)].view(torch.int64).copy_(torch.tensor(rows, dtype=torch.int64))
        bitmask = host[8 * len(rows) :].view(torch.int32).view(len(rows), self.words)
        matchers = [sampled[i].matcher for i in rows]

        @torch.inference_mode()  # the buffer was made in the step's inference mode
        def fill() -> tuple[torch.Tensor, dict[int, str]]:
            started = time.perf_counter()
            # batched and parallel per backend; the empty-mask check is here, off the engine thread
            failures = fill_bitmasks(matchers, bitmask, max_threads=self.threads, valid_bits=self._valid_bits)
            self.last_fill_s = time.perf_counter() - started
            self.stats.mask_fill_s += self.last_fill_s
            return host, failures

        return self._pool.submit(fill), rows

    def finish(self, fill: Fill | None, sampled: list[Sequence], fail: Callable[[Sequence, str], None]):
        """Wait for the bitmask and ``fail`` the rows whose matcher raised or allows nothing;
        returns (bitmask [M, W] int32, row indices [M] int64) on the model's device, both views
        of one non-blocking copy from the staging buffer (None, None without masked rows)."""
        if fill is None:
            return None, None
        future, masked = fill
        host, failures = future.result()
        for i, message in failures.items():
            fail(sampled[masked[i]], message)
        staged = self._staging.upload(host)
        rows = len(masked)
        return staged[8 * rows :].view(torch.int32).view(rows, self.words), staged[: 8 * rows].view(torch.int64)

    @staticmethod
    def wait_quietly(fill: Fill | None) -> None:
        """Wait for ``fill`` to end (its matchers must be idle before anyone touches them again)."""
        if fill is not None:
            try:
                fill[0].result()
            except Exception:
                log.exception("constraint mask fill failed")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def needs_host_mask(seq: Sequence) -> bool:
    """Constrained rows whose mask is not computed on the device by a resident DFA."""
    return seq.matcher is not None and seq.row.dfa is None


def _valid_bits(vocab_size: int, words: int) -> torch.Tensor:
    """int32 [words]: the bitmask bits that stand for real tokens."""
    valid = torch.full((words,), -1, dtype=torch.int32)
    if vocab_size % 32:
        valid[-1] = (1 << (vocab_size % 32)) - 1
    return valid
