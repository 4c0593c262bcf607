"""GPU-resident token DFA: mask logits by per-row DFA states and advance the states.

Table layout (shared by all rows using the same DFA):
    allowed        int32 [S, W]   packed bitmask of allowed tokens per state (xgrammar layout)
    trans_offsets  int32 [S + 1]  CSR row pointers
    trans_tokens   int32 [E]      tokens with a transition, sorted within each state
    trans_next     int32 [E]      target state of each transition

State -1 is the terminal / dead state: a token with no transition from the current state
(e.g. a stop token, which ends the constrained sequence) moves the row to -1, and -1
stays -1. Rows in state -1 are left untouched by :func:`dfa_apply_mask_inplace`.
"""

from __future__ import annotations

import torch

from kernels._backend import select_backend, triton_kernels
from kernels.bitmask import mask_rows


def dfa_apply_mask_inplace(
    logits: torch.Tensor,
    allowed: torch.Tensor,
    states: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> None:
    """Mask logits row ``indices[r]`` by ``allowed[states[r]]`` in place.

    Args:
        logits: [B, V] float, modified in place (-inf where banned; columns past
            ``W * 32`` are banned).
        allowed: [S, W] int32 packed per-state bitmasks.
        states: [R] int32 current states; rows with a negative state are untouched.
        indices: [R] long logits rows (None: row ``r``). Must be unique.
        use_triton: see :func:`kernels.apply_token_bitmask_inplace`.

    No bitmask is materialised and nothing is read back to the host.
    """
    if allowed.dtype != torch.int32 or allowed.dim() != 2:
        raise TypeError("allowed must be an int32 [S, W] tensor")
    if indices is not None and indices.shape != states.shape:
        raise ValueError("states and indices must both be [R]")
    mask_rows(logits, allowed, states, indices, states.numel(), use_triton)


def _search_iterations(n_transitions: int, max_degree: int | None) -> int:
    """Binary-search steps that cover the largest CSR segment."""
    bound = n_transitions if max_degree is None else min(max_degree, n_transitions)
    return max(1, int(bound).bit_length())


def dfa_advance_reference(
    states: torch.Tensor,
    tokens: torch.Tensor,
    trans_offsets: torch.Tensor,
    trans_tokens: torch.Tensor,
    trans_next: torch.Tensor,
    max_degree: int | None = None,
) -> torch.Tensor:
    """Pure-torch twin of :func:`dfa_advance` (the same vectorised binary search)."""
    states = states.to(torch.int32)
    tokens = tokens.to(torch.int32)
    alive = states >= 0  # [R]
    safe = states.clamp(min=0).long()
    lo = torch.where(alive, trans_offsets[safe], 0).long()  # [R]
    end = torch.where(alive, trans_offsets[safe + 1], 0).long()  # [R]
    hi = end.clone()
    n_edges = trans_tokens.numel()
    if n_edges == 0:
        return torch.full_like(states, -1)
    for _ in range(_search_iterations(n_edges, max_degree)):
        active = lo < hi
        mid = (lo + hi) // 2
        right = trans_tokens[mid.clamp(max=n_edges - 1)] < tokens
        lo = torch.where(active & right, mid + 1, lo)
        hi = torch.where(active & ~right, mid, hi)
    pos = lo.clamp(max=n_edges - 1)
    hit = alive & (lo < end) & (trans_tokens[pos] == tokens)
    return torch.where(hit, trans_next[pos], -1).to(torch.int32)


def dfa_advance(
    states: torch.Tensor,
    tokens: torch.Tensor,
    trans_offsets: torch.Tensor,
    trans_tokens: torch.Tensor,
    trans_next: torch.Tensor,
    max_degree: int | None = None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Next DFA state of each row after consuming ``tokens[r]``; stays on the device.

    Args:
        states: [R] int32 current states (-1 = terminal).
        tokens: [R] int32/long consumed tokens.
        trans_offsets, trans_tokens, trans_next: CSR transition table (see module doc).
        max_degree: largest number of transitions of any state (bounds the search);
            None uses ``E``.

    Returns:
        [R] int32: the target state, or -1 when the token has no transition (stop token
        or invalid token) or the row was already at -1.
    """
    if states.shape != tokens.shape or states.dim() != 1:
        raise ValueError("states and tokens must both be [R]")
    if trans_tokens.numel() == 0 or states.numel() == 0:
        return torch.full_like(states, -1, dtype=torch.int32)
    if select_backend(states, use_triton) == "triton":
        n_iters = _search_iterations(trans_tokens.numel(), max_degree)
        return triton_kernels().dfa_advance(
            states.to(torch.int32).contiguous(), tokens.contiguous(),
            trans_offsets, trans_tokens, trans_next, n_iters,
        )
    return dfa_advance_reference(states, tokens, trans_offsets, trans_tokens, trans_next, max_degree)
