"""Sampled tokens the host has not read yet: the overlapped loop's hand-over between steps.

In the overlapped loop a step's sampled ids stay on the device: the next step's forward takes
them from there (:meth:`InFlight.gather_into`) and is launched before the host reads them, by
one non-blocking copy, while the device computes. Until then a sequence's next token is the
placeholder :data:`SAMPLED`, in its pending tokens and, once fed, in its block table;
:func:`resolve` writes the real id into whichever holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sampler import SampleResult
from sampler.params import PendingSample
from sampler.pool import to_device
from server.engine.sequence import SAMPLED, Sequence


class ReadyEvent:
    """A device event for devices that compute synchronously (the CPU): always done, and work
    between two of them takes the device no time of its own."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def device_event(runner, *, timing: bool = False) -> Any:
    """An event to record after a step's work is queued: the runner's own (``new_event``, e.g.
    an emulated device), a CUDA event (``timing``: one that can time the work since another),
    or one that is always done."""
    make = getattr(runner, "new_event", None)
    if make is not None:
        return make()
    if runner.device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing)
    return ReadyEvent()


@dataclass
class InFlight:
    """One sampler pass over ``seqs`` whose ids are on their way to the host."""

    seqs: list[Sequence]
    sample: PendingSample
    event: Any
    hidden: torch.Tensor | None = None  # [H, D] last-layer states of the rows in ``hidden_rows``
    hidden_rows: list[int] = field(default_factory=list)
    forward_events: tuple[Any, Any] | None = None  # recorded around the forward's launch
    forward_tokens: int = 0  # tokens the forward fed
    forward_launch_s: float = 0.0  # host seconds the forward took to launch
    _row_of: dict[int, int] | None = None

    def row_of(self, seq: Sequence) -> int | None:
        """``seq``'s row in this pass (None: not sampled in it)."""
        if self._row_of is None:
            self._row_of = {id(s): i for i, s in enumerate(self.seqs)}
        return self._row_of.get(id(seq))

    def gather_into(self, tokens: torch.Tensor, positions: list[int], rows: list[int]) -> None:
        """Write this pass's ids of ``rows`` into ``tokens`` at ``positions``, on the device."""
        ids = self.sample.ids
        index = to_device(positions + rows, torch.long, ids.device)
        tokens.index_copy_(0, index[: len(positions)], ids.index_select(0, index[len(positions) :]))

    def wait(self) -> SampleResult:
        """The host's copy of the ids and logprobs, once the device has made it."""
        self.event.synchronize()
        return self.sample.result()

    def forward_ms(self) -> float | None:
        """The forward's device time, once :meth:`wait` returned (None: not timed)."""
        if self.forward_events is None:
            return None
        start, end = self.forward_events
        try:
            return float(start.elapsed_time(end))
        except Exception:  # an event that cannot time (not created for it)
            return None

    def hidden_lists(self) -> dict[int, list[float]]:
        """{row: its hidden state} for the rows that asked, read back in one transfer."""
        if self.hidden is None or not self.hidden_rows:
            return {}
        return dict(zip(self.hidden_rows, self.hidden.float().cpu().tolist()))


def resolve(seq: Sequence, token: int) -> bool:
    """Put the real id of ``seq``'s sampled token where its placeholder is; True when the
    token was already fed to the model (it is in the block table)."""
    if seq.pending and seq.pending[0] == SAMPLED:
        seq.pending[0] = token
        return False
    tokens = seq.table.tokens
    if tokens and tokens[-1] == SAMPLED:
        tokens[-1] = token
        return True
    if SAMPLED in seq.pending:  # preempted after it was fed: it waits to be recomputed
        seq.pending[seq.pending.index(SAMPLED)] = token
    return False


def unfeed(seq: Sequence, token: int, fed: bool) -> None:
    """Take back the sampled ``token`` (the sequence goes on with other tokens): out of the
    pending tokens, or out of the cache when the overlapped step already fed it (its keys and
    values are overwritten by what is fed next)."""
    if fed:
        seq.table.truncate(seq.cached_len - 1)
    elif seq.pending[:1] == [token]:
        seq.pending.pop(0)
