"""The rotary embedding's cos/sin per position, computed once: a step gathers its tokens' rows
in one kernel instead of recomputing the angles (about ten small kernels per step).

transformers' own rotary module computes the table, so every rope scaling it knows (linear,
llama3, yarn, ...) is applied exactly as in its forward; an angle depends only on its position,
so the gathered rows are the values a per-step call would give. Scalings that rescale with the
sequence length (``dynamic``, ``longrope``) keep the per-step call.
"""

from __future__ import annotations

import torch
from torch import nn

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RotaryTable:
    """cos/sin [N, head_dim] of any positions below ``max_positions`` (the KV cache's capacity:
    no sequence's token sits further)."""

    def __init__(self, rotary: nn.Module, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rotary = rotary
        self.dtype = dtype
        self.table: torch.Tensor | None = None  # [P, 2, head_dim]: cos then sin of each position
        if getattr(rotary, "rope_type", "default") not in LENGTH_DEPENDENT_ROPE:
            cos, sin = self._compute(torch.arange(max_positions, device=device))
            self.table = torch.stack((cos, sin), dim=1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` [N]: [N, head_dim] each (views sharing one row stride)."""
        if self.table is None:
            return self._compute(positions)
        rows = self.table.index_select(0, positions)
        return rows[:, 0], rows[:, 1]

    @torch.inference_mode()
    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=self.dtype, device=positions.device)  # the module reads its dtype and device
        cos, sin = self.rotary(probe, positions.view(1, -1))
        return cos[0], sin[0]
