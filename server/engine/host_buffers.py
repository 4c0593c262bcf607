"""Reusable host staging buffers for the engine's per-step host→device copies.

On CUDA a copy from pageable host memory is staged through a driver buffer and holds the host
until it is done; a copy from page-locked (pinned) memory with ``non_blocking=True`` is queued on
the stream and returns at once, so the host goes on while the device copies. Pinning memory is
slow, so the buffers are kept and reused: a step's arrays are packed into one buffer and copied
once (:class:`HostStaging`).

A buffer may be refilled only once the copy that last read it has finished. Each
:class:`HostStaging` rotates over ``slots`` buffers (two by default: while step N's copy may still
be in flight, step N+1 fills the other one) and records a CUDA event after each copy; taking a
buffer waits on that buffer's event first (by then it has normally long completed: every step
reads its sampled ids back). On the CPU there is nothing to copy: :meth:`HostStaging.buffer`
returns a fresh tensor and :meth:`HostStaging.upload` returns it as is.
"""

from __future__ import annotations

import torch

MIN_BUFFER_BYTES = 4096


class HostStaging:
    """Host buffers for one kind of per-step upload (one instance per kind and thread of use).

    Use: ``host = staging.buffer(nbytes)``, fill ``host`` (any dtype through ``host.view``),
    then ``device_tensor = staging.upload(host)``, before the next :meth:`buffer` of the same slot
    comes round. The uploaded tensor is the device's own (freshly allocated), safe to keep.
    """

    def __init__(self, device: torch.device | str, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` to fill: the next slot's pinned buffer (grown as
        needed, once its last copy has finished) on CUDA, a fresh tensor elsewhere."""
        if not self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None and not event.query():
            event.synchronize()  # the previous copy out of this buffer is still running
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(_grown(nbytes), dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (from :meth:`buffer`, any view of it) on the device: one non-blocking copy
        from the pinned buffer, after which the buffer's slot records an event; the CPU tensor
        itself on the CPU."""
        if not self.pinned:
            return host
        slot = self._slot_of(host)
        out = host.to(self.device, non_blocking=True)
        event = self._events[slot]
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return out

    def _slot_of(self, host: torch.Tensor) -> int:
        pointer = host.untyped_storage().data_ptr()
        for slot, buf in enumerate(self._buffers):
            if buf is not None and buf.untyped_storage().data_ptr() == pointer:
                return slot
        raise ValueError("upload() takes a tensor returned by this HostStaging's buffer()")


def _grown(nbytes: int) -> int:
    """Capacity for a request of ``nbytes``: the next power of two (few regrowths)."""
    return max(MIN_BUFFER_BYTES, 1 << max(nbytes - 1, 0).bit_length())
