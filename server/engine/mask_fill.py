"""The step's constraint bitmasks, filled on the mask thread into a staging buffer.

Rows whose constraint is followed on the host (a matcher, not a device-resident DFA) get their
bitmask filled on the worker of the engine's :class:`~server.engine.bounded_calls.BoundedCalls`
(the mask thread) while the engine thread goes on; the row indices and the bitmasks travel to
the device in one non-blocking copy from a pinned, reused buffer.

Each row's fill is a bounded call of its own, except the rows a backend fills in one batched
native call (:func:`constraints.backends.batch_fill.fill_bitmasks`: xgrammar's and llguidance's
parallel fills, for groups large enough), which share one: which of them hung cannot be told. A
fill over the bound ends its rows (``abandon``); the call may still write its rows later, so
that step's bitmask is uploaded from a copy and the staging buffers are replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from constraints.backends.batch_fill import default_threads, fail_empty_rows, fill_bitmasks, fill_threads
from server.engine.bounded_calls import Batch, BoundedCalls
from server.engine.failures import describe
from server.engine.host_buffers import HostStaging
from server.engine.sequence import Sequence

log = logging.getLogger("trellis.engine")

Unit = range  # bitmask rows filled by one bounded call


@dataclass
class Fill:
    """A fill under way: its calls, the batch rows it masks (in bitmask order), its buffer
    (row indices [M] int64, then the bitmask [M, W] int32) and its failed rows {row: error}."""

    batch: Batch
    rows: list[int]
    host: torch.Tensor
    failures: dict[int, str]


class MaskFill:
    """Fills bitmasks [M, ceil(V/32)] int32 for the host-masked rows of a sampler pass."""

    def __init__(self, vocab_size: int, device: torch.device, threads: int, stats, calls: BoundedCalls) -> None:
        self.threads = threads
        self.stats = stats
        self.last_fill_s = 0.0  # how long the last fill took on the mask thread
        self.words = (vocab_size + 31) // 32
        self._valid_bits = _valid_bits(vocab_size, self.words)
        self._staging = HostStaging(device)
        self._calls = calls

    def start(self, sampled: list[Sequence]) -> Fill | None:
        """Start filling the masks of the rows of ``sampled`` whose mask the host computes, into
        a staging buffer: the row indices [M] int64, then the bitmask [M, W] int32."""
        masked = [i for i, seq in enumerate(sampled) if needs_host_mask(seq)]
        if not masked:
            return None
        groups = self._groups([sampled[i].matcher for i in masked])
        rows = [masked[j] for group in groups for j in group]  # a batched group's rows side by side
        matchers = [sampled[i].matcher for i in rows]
        host, bitmask = self._staged(rows)
        failures: dict[int, str] = {}
        clock: list[float] = []  # when the worker took the fill up (not when it was queued)
        calls: list[tuple[Unit | None, Callable[[], None]]] = [(None, lambda: clock.append(time.perf_counter()))]
        first = 0
        for group in groups:
            unit = range(first, first + len(group))
            calls.append((unit, partial(self._fill, matchers[first : unit.stop], bitmask, first, failures)))
            first = unit.stop
        calls.append((None, partial(self._check, bitmask, failures, clock)))
        return Fill(self._calls.start(calls), rows, host, failures)

    def finish(self, fill: Fill | None, sampled: list[Sequence], fail: Callable[[Sequence, str], None],
               abandon: Callable[[Sequence, str], None]):
        """Wait for the bitmask; ``abandon`` the rows whose fill ran over the bound and ``fail``
        those whose matcher raised or allows nothing. Returns (bitmask [M, W] int32, row indices
        [M] int64) on the model's device, both views of one non-blocking copy from the staging
        buffer (None, None without masked rows)."""
        if fill is None:
            return None, None
        stuck = {row for unit in self._calls.wait(fill.batch) if unit is not None for row in unit}
        host = fill.host if not stuck else self._rescue(fill.host, len(fill.rows), stuck)
        for row in sorted(stuck):
            abandon(sampled[fill.rows[row]], "filling its token mask")
        for row, message in dict(fill.failures).items():  # a copy: a stuck fill may still add to it
            if row not in stuck:
                fail(sampled[fill.rows[row]], message)
        return self._device_views(self._staging.upload(host), len(fill.rows))

    def stage_allowing_all(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask, row indices) on the device as :meth:`finish` returns them for ``rows``, every
        token allowed: the same buffer layout, so the same alignments (the kernel warm-up's)."""
        host, bitmask = self._staged(rows)
        bitmask.fill_(-1)
        return self._device_views(self._staging.upload(host), len(rows))

    def _staged(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer holding ``rows`` as int64 indices, and its bitmask view [M, W] to fill."""
        host = self._staging.buffer(_head(len(rows)) + 4 * len(rows) * self.words)
        host[: 8 * len(rows)].view(torch.int64).copy_(torch.tensor(rows, dtype=torch.int64))
        return host, host[_head(len(rows)) :].view(torch.int32).view(len(rows), self.words)

    def _device_views(self, staged: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return staged[_head(rows) :].view(torch.int32).view(rows, self.words), staged[: 8 * rows].view(torch.int64)

    def wait_quietly(self, fill: Fill | None) -> None:
        """Wait for ``fill`` to end or be abandoned (its matchers must be idle before anyone
        touches them again; the step's rows are failed by the caller)."""
        if fill is not None:
            try:
                self._calls.wait(fill.batch)
            except Exception:
                log.exception("constraint mask fill failed")

    def _groups(self, matchers: list[Any]) -> list[list[int]]:
        """Positions of ``matchers`` by bounded call: one per group that ``fill_bitmasks`` fills
        in one batched call (as it would choose for them), one per other row; in row order."""
        threads = self.threads if self.threads > 0 else default_threads(len(matchers))
        by_fill: dict[Any, list[int]] = {}
        groups = []
        for i, matcher in enumerate(matchers):
            batch_fill = getattr(type(matcher), "fill_bitmask_batch", None)
            if batch_fill is None:
                groups.append([i])
            else:
                by_fill.setdefault(batch_fill, []).append(i)
        for group in by_fill.values():
            groups += [group] if fill_threads(len(group), threads) > 1 else [[i] for i in group]
        return sorted(groups)

    def _fill(self, matchers: list[Any], bitmask: torch.Tensor, first: int, failures: dict[int, str]) -> None:
        """One bounded call: a row's fill, or a batched group's (rows from ``first`` on)."""
        if len(matchers) > 1:
            found = fill_bitmasks(matchers, bitmask[first : first + len(matchers)], max_threads=self.threads)
            failures.update((first + i, message) for i, message in found.items())
            return
        try:
            matchers[0].fill_bitmask(bitmask, first)
        except Exception as exc:  # noqa: BLE001 - a failing matcher fails its own row
            failures[first] = f"constraint matcher failed: {describe(exc)}"
            bitmask[first] = -1  # the row is dropped; a full mask keeps the sampler's math sane

    def _check(self, bitmask: torch.Tensor, failures: dict[int, str], clock: list[float]) -> None:
        """Last, on the mask thread: rows that allow no token fail; the fill's time is recorded."""
        fail_empty_rows(bitmask, self._valid_bits, failures)
        self.last_fill_s = time.perf_counter() - clock[0]
        self.stats.mask_fill_s += self.last_fill_s

    def _rescue(self, host: torch.Tensor, count: int, stuck: set[int]) -> torch.Tensor:
        """``host`` copied where an abandoned fill cannot write, its ``stuck`` rows allowing every
        token; the staging buffers it came from are never used again."""
        self._staging = HostStaging(self._staging.device, self._staging.slots)
        copy = self._staging.buffer(host.numel())
        copy.copy_(host)
        copy[_head(count) :].view(torch.int32).view(count, self.words)[sorted(stuck)] = -1
        return copy


def _head(rows: int) -> int:
    """Bytes before the bitmask in a staging buffer: the row indices, padded to 16 bytes (the
    bitmask's device view stays aligned, so the mask kernel has one Triton variant)."""
    return 16 * -(-rows // 2)


def needs_host_mask(seq: Sequence) -> bool:
    """Constrained rows whose mask is not computed on the device by a resident DFA."""
    return seq.matcher is not None and seq.row.dfa is None


def _valid_bits(vocab_size: int, words: int) -> torch.Tensor:
    """int32 [words]: the bitmask bits that stand for real tokens."""
    valid = torch.full((words,), -1, dtype=torch.int32)
    if vocab_size % 32:
        valid[-1] = (1 << (vocab_size % 32)) - 1
    return valid
