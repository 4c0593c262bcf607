"""Device pools of per-row penalty state (output-token counts, prompt-token mask)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without a blocking copy (pinned + non_blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PenaltyPool:
    """Slot-indexed ``counts`` int32 [C, V] and ``prompt_mask`` bool [C, V] on the device.

    Rows with penalties own one slot; the pool doubles when full. Updates are batched
    scatters (``add_tokens``), never per-token host work beyond building index lists.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._free = list(range(capacity - 1, -1, -1))

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def allocate(self, prompt_token_ids: Sequence[int]) -> int:
        """Take a slot, zero its counts and mark the prompt tokens."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        ids = [t for t in prompt_token_ids if 0 <= t < self.vocab_size]
        if ids:
            self.prompt_mask[slot, to_device(ids, torch.long, self.device)] = True
        return slot

    def release(self, slot: int) -> None:
        """Return a slot (called when its row is garbage-collected or released)."""
        self._free.append(slot)

    def add_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """counts[slots[i], tokens[i]] += 1 for all i, in one scatter."""
        if not slots:
            return
        idx = to_device(slots + tokens, torch.long, self.device).view(2, -1)
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
        self.counts.index_put_((idx[0], idx[1]), ones, accumulate=True)
