"""Fill the allowed-token bitmasks of a whole batch of matchers, in parallel where it pays.

Rows are grouped by matcher class. A class that offers a batched fill (a ``fill_bitmask_batch``
classmethod: xgrammar's ``BatchGrammarMatcher``, llguidance's ``LLExecutor``, both computing on
their own native thread pools with the GIL released) fills a group large enough for several
threads in one call; smaller groups and every other matcher (the token DFA: one row copy) are
filled on the calling thread, row by row. A group whose batched call raises is filled again
row by row, so a failing matcher fails only its own row, with the message the row-by-row fill
gives.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

# rows each fill thread should have before one more thread is worth waking; a group that gets
# one thread is filled row by row on the calling thread: llguidance's executor hands even a
# one-thread batch to a pool thread, and that hand-off costs more than it saves
# (benchmarks/mask_fill.py)
ROWS_PER_THREAD = 4

EMPTY_MASK = "constraint matcher failed: no token is allowed (empty mask)"


def default_threads(rows: int) -> int:
    """Fill threads for ``rows`` rows when no setting is given: one per row up to one per core."""
    return max(1, min(rows, os.cpu_count() or 1))


def fill_threads(rows: int, max_threads: int) -> int:
    """Threads a group of ``rows`` rows is filled with: a power of two (few pools stay alive),
    at most ``max_threads`` and at most one per ``ROWS_PER_THREAD`` rows."""
    cap = max(1, min(max_threads, rows // ROWS_PER_THREAD))
    return 1 << (cap.bit_length() - 1)


def fill_bitmasks(
    matchers: Sequence[Any],
    bitmask: "torch.Tensor",
    *,
    max_threads: int = 0,
    valid_bits: "torch.Tensor | None" = None,
) -> dict[int, str]:
    """Write ``matchers[i]``'s allowed tokens into ``bitmask[i]`` for every row.

    Returns the failed rows as {row: message}: a row whose matcher raised, or (with
    ``valid_bits``, int32 [W]: the bits that stand for real tokens) one that allows no token.
    A failed row is set to all ones so the sampler's math stays sane; its sequence is dropped.
    ``max_threads`` caps the fill threads (0: ``default_threads``).
    """
    threads = max_threads if max_threads > 0 else default_threads(len(matchers))
    failures: dict[int, str] = {}
    for batch_fill, rows in _groups(matchers).items():
        group = [matchers[i] for i in rows]
        if batch_fill is None or not _fill_group(batch_fill, group, bitmask, rows, threads):
            _fill_rows(matchers, bitmask, rows, failures)
    for i in failures:
        bitmask[i] = -1  # the row is dropped; a full mask keeps the sampler's math sane
    if valid_bits is not None:
        fail_empty_rows(bitmask, valid_bits, failures)
    return failures


def _groups(matchers: Sequence[Any]) -> dict[Any, list[int]]:
    """Row indices by batched-fill function (None: filled row by row), in row order."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, matcher in enumerate(matchers):
        groups[getattr(type(matcher), "fill_bitmask_batch", None)].append(i)
    return groups


def _fill_group(batch_fill, group: list[Any], bitmask: "torch.Tensor", rows: list[int], threads: int) -> bool:
    """One batched call for the group on several threads; False when the group is better
    filled row by row: one thread would do, a matcher is listed twice (two threads must not
    fill it at once), or the batched call raised."""
    threads = fill_threads(len(rows), threads)
    if threads == 1 or len({id(m) for m in group}) < len(group):
        return False
    try:
        batch_fill(group, bitmask, rows, threads)
    except Exception:
        return False
    return True


def _fill_rows(matchers: Sequence[Any], bitmask: "torch.Tensor", rows: list[int], failures: dict[int, str]) -> None:
    for i in rows:
        try:
            matchers[i].fill_bitmask(bitmask, i)
        except Exception as exc:
            failures[i] = f"constraint matcher failed: {type(exc).__name__}: {exc}"


def fail_empty_rows(bitmask: "torch.Tensor", valid_bits: "torch.Tensor", failures: dict[int, str]) -> None:
    """Record rows that allow no token (of the ``valid_bits``) in ``failures`` and set them full."""
    # numpy, not torch: torch spreads a [64, W] reduction over its intra-op thread team, which
    # the forward running beside this fill is using (measured: 100 ms instead of 0.1 ms on a
    # loaded 2-core machine)
    words = bitmask.numpy()
    empty = np.flatnonzero(~(words & valid_bits.numpy()).any(axis=1)).tolist()
    for i in empty:
        failures[i] = EMPTY_MASK
        words[i] = -1
