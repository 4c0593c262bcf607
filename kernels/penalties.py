"""Fused sampling prep: repetition/presence/frequency penalties (+ temperature) in one pass.

Per-row penalty state lives in pools indexed by a slot id:
    counts       int32 [C, V']  occurrences of each token in the row's output so far
    prompt_mask  bool  [C, V']  token occurs in the prompt (for the repetition penalty)
with ``V' >= V``. Semantics follow vLLM / OpenAI:
    repetition (tokens in prompt or output): x > 0 -> x / rep, else x * rep
    frequency  (output only):                x -= frequency * count
    presence   (output only):                x -= presence * (count > 0)
then, if given, ``x *= inv_temperature``.
"""

from __future__ import annotations

import torch

from kernels._backend import select_backend, triton_kernels


def apply_penalties_reference(
    logits: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    indices: torch.Tensor | None = None,
    inv_temperature: torch.Tensor | None = None,
) -> None:
    """Pure-torch reference of :func:`apply_penalties_inplace` (the CPU path)."""
    n_cols = logits.shape[1]
    slots = slots.long()
    rows = logits.float() if indices is None else logits[indices.long()].float()  # [R, V]
    cnt = counts[slots, :n_cols]  # [R, V] int32
    seen = (cnt > 0) | prompt_mask[slots, :n_cols]  # [R, V]
    rep = repetition.unsqueeze(1)  # [R, 1]
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows = rows - frequency.unsqueeze(1) * cnt.float()
    rows = rows - presence.unsqueeze(1) * (cnt > 0).float()
    if inv_temperature is not None:
        rows = rows * inv_temperature.unsqueeze(1)
    if indices is None:
        logits.copy_(rows)
    else:
        logits[indices.long()] = rows.to(logits.dtype)


def apply_penalties_inplace(
    logits: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    indices: torch.Tensor | None = None,
    inv_temperature: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> None:
    """Apply penalties (and optionally temperature) to logits rows in place.

    Args:
        logits: [B, V] float, modified in place.
        slots: [R] int pool slot of each penalised row.
        counts: [C, V'] int32 output-token counts pool (``V' >= V``).
        prompt_mask: [C, V'] bool prompt-token pool.
        repetition, presence, frequency: [R] float32 per-row parameters.
        indices: [R] long logits rows to process (None: rows ``0..R-1``, ``R == B``).
        inv_temperature: optional [R] float32, multiplied in after the penalties.
        use_triton: see :func:`kernels.apply_token_bitmask_inplace`.
    """
    if counts.shape[1] < logits.shape[1] or prompt_mask.shape[1] < logits.shape[1]:
        raise ValueError("penalty pools are narrower than the logits")
    if indices is None and slots.numel() != logits.shape[0]:
        raise ValueError("without indices, slots must cover every logits row")
    if slots.numel() == 0:
        return
    if select_backend(logits, use_triton) == "triton" and logits.stride(1) == 1:
        vec = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
        triton_kernels().apply_penalties(
            logits, None if indices is None else indices.contiguous(), slots.contiguous(),
            counts.contiguous(), prompt_mask.contiguous().view(torch.uint8),
            vec(repetition), vec(presence), vec(frequency), vec(inv_temperature),
        )
        return
    apply_penalties_reference(
        logits, slots, counts, prompt_mask, repetition, presence, frequency, indices,
        inv_temperature,
    )
