"""Apply a packed token bitmask (xgrammar layout) to logits rows in place."""

from __future__ import annotations

import torch

from kernels._backend import select_backend, triton_kernels
from kernels.cpu_fused import cpu_fused_ops, fusable

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    """[32] int32 tensor 0..31 on ``device`` (cached)."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def banned_from_bitmask(words: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Packed int32 words [R, W] -> bool banned [R, n_cols] (True = bit is 0 or column
    past ``W * 32``). Bit ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed."""
    n_rows, n_words = words.shape
    banned = ((words.unsqueeze(-1) >> _bit_shifts(words.device)) & 1) == 0  # [R, W, 32]
    banned = banned.view(n_rows, n_words * 32)  # [R, W*32]
    if n_words * 32 >= n_cols:
        return banned[:, :n_cols]
    pad = banned.new_ones(n_rows, n_cols - n_words * 32)
    return torch.cat([banned, pad], dim=1)


def unpack_bitmask(words: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Packed int32 words [R, W] -> bool allowed [R, n_cols] (see ``banned_from_bitmask``)."""
    return ~banned_from_bitmask(words, n_cols)


def _mask_rows_reference(
    logits: torch.Tensor,
    words: torch.Tensor,
    word_rows: torch.Tensor | None,
    dst_rows: torch.Tensor | None,
) -> None:
    """Pure-torch twin of the Triton ``mask_rows`` launcher (no host sync)."""
    live = None
    if word_rows is not None:
        live = word_rows >= 0  # [R]; negative word rows leave their logits row untouched
        words = words[word_rows.clamp(min=0).long()]  # [R, W]
    banned = banned_from_bitmask(words, logits.shape[1])  # [R, V]
    if live is not None:
        banned &= live.unsqueeze(1)
    if dst_rows is None:
        logits[: banned.shape[0]].masked_fill_(banned, float("-inf"))
        return
    dst_rows = dst_rows.long()
    rows = logits.index_select(0, dst_rows).masked_fill_(banned, float("-inf"))  # [R, V]
    logits.index_copy_(0, dst_rows, rows)


def mask_rows(
    logits: torch.Tensor,
    words: torch.Tensor,
    word_rows: torch.Tensor | None,
    dst_rows: torch.Tensor | None,
    n_rows: int,
    use_triton: bool | None = None,
) -> None:
    """Shared dispatcher of the bitmask and DFA masks (see the public functions)."""
    if n_rows == 0 or logits.shape[1] == 0:
        return
    if select_backend(logits, use_triton) == "triton" and logits.stride(1) == 1:
        contig = lambda t: None if t is None else t.contiguous()  # noqa: E731
        triton_kernels().mask_rows(logits, words.contiguous(), contig(word_rows), contig(dst_rows), n_rows)
    elif not _mask_rows_fused(logits, words, word_rows, dst_rows):
        _mask_rows_reference(logits, words, word_rows, dst_rows)


def _mask_rows_fused(logits: torch.Tensor, words: torch.Tensor, word_rows: torch.Tensor | None,
                     dst_rows: torch.Tensor | None) -> bool:
    """The reference's masking in one C++ call (:mod:`kernels.cpu_fused`) for float32 CPU
    logits; False where it does not apply (it is not built, another dtype or device)."""
    if not fusable(logits) or logits.stride(1) != 1 or not words.is_cpu or words.dtype != torch.int32:
        return False
    ops = cpu_fused_ops()
    if ops is None:
        return False
    if word_rows is not None:  # mask row r is bitmask row word_rows[r] (negative: row r untouched)
        words = words[word_rows.clamp(min=0).long()]
    dst = dst_rows.long() if dst_rows is not None else torch.arange(words.shape[0])
    if word_rows is not None:
        dst = torch.where(word_rows >= 0, dst, -1)
    ops.mask_rows(logits, words.contiguous(), dst)
    return True


def _check(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits must be [B, V] and bitmask [R, W]")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError("bitmask and logits must be on the same device")
    if indices is None and bitmask.shape[0] > logits.shape[0]:
        raise ValueError("bitmask has more rows than logits and no indices were given")
    if indices is not None and indices.shape != (bitmask.shape[0],):
        raise ValueError("indices must be [R], one logits row per bitmask row")


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Pure-torch reference of :func:`apply_token_bitmask_inplace` (the CPU path)."""
    _check(logits, bitmask, indices)
    if bitmask.shape[0] and logits.shape[1]:
        _mask_rows_reference(logits, bitmask, None, indices)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> None:
    """Set ``logits[row, t] = -inf`` for every token ``t`` the bitmask bans.

    Args:
        logits: [B, V] float tensor, modified in place.
        bitmask: [R, W] int32; bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed
            (xgrammar's layout). Columns ``>= W * 32`` are banned on masked rows; bits past
            ``V`` are ignored.
        indices: [R] long/int; bitmask row ``r`` masks logits row ``indices[r]``. Other rows
            are untouched. None means row ``r`` masks logits row ``r`` (``R <= B``).
            Indices must be unique.
        use_triton: None = Triton on CUDA; True also runs it on CPU when
            ``TRITON_INTERPRET=1``; False forces the torch reference.
    """
    _check(logits, bitmask, indices)
    mask_rows(logits, bitmask, None, indices, bitmask.shape[0], use_triton)


def apply_token_bitmask_rows_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    word_rows: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Mask every logits row ``r`` by bitmask row ``word_rows[r]``; rows with a negative entry
    are untouched. Same masking as :func:`apply_token_bitmask_inplace`, but with one program
    per logits row whatever the number of constrained rows, so the shapes are static and the
    call can be captured in a CUDA graph.

    Args:
        logits: [B, V] float tensor, modified in place.
        bitmask: [N, W] int32 (xgrammar's layout); only the rows ``word_rows`` names are read.
        word_rows: [B] integer tensor on the logits' device.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or word_rows.shape != (logits.shape[0],):
        raise ValueError("logits must be [B, V], bitmask [N, W] and word_rows [B]")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    mask_rows(logits, bitmask, word_rows, None, logits.shape[0], use_triton)
