"""One engine step flattened for the model runner: every row's new tokens back to back.

A row is one sequence this step: its block table (physical KV blocks in order), its new tokens
(one for a decoding row, several for a prefill chunk, a jump-forward continuation, a draft or a
scored choice) and how many of its tokens the cache already holds. The runner writes the new
tokens' keys/values into the row's blocks and attends over the row's whole context in one
attention call per layer (:mod:`kernels.paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.paged_attention import PagedAttentionMetadata, block_runs, host_layout
from server.engine.host_buffers import HostStaging
from server.engine.lora import LoraGroups

if TYPE_CHECKING:
    from server.engine.vision.media import StepMedia

Row = tuple[list[int], list[int], int]  # (block table, new tokens, tokens already cached)


@dataclass
class StepBatch:
    """tokens / positions: [N] per new token. last_index: the token indices where logits are
    taken: each row's last token, or its last ``logit_counts[i]`` tokens for rows that ask for
    per-position logits (draft verification, choice scoring). attn: where keys/values go and
    what each row attends to."""

    tokens: torch.Tensor
    positions: torch.Tensor
    last_index: torch.Tensor
    attn: PagedAttentionMetadata
    logit_counts: list[int] | None = None  # None: one logits row per batch row
    lora: LoraGroups | None = None  # tokens grouped by LoRA adapter; None = all on the base model
    prompt_mask: torch.Tensor | None = None  # [N] bool: the token is a prompt token; None = none is
    media: StepMedia | None = None  # image rows and M-RoPE positions (vision-language models)

    @property
    def num_rows(self) -> int:
        return self.attn.num_rows

    @property
    def all_single(self) -> bool:
        """Every row feeds exactly one token (so row i's last token is token i)."""
        return self.attn.max_query_len <= 1

    @staticmethod
    def build(
        rows: list[Row],
        block_size: int,
        device: torch.device,
        logit_counts: list[int] | None = None,
        row_adapters: list[int] | None = None,
        staging: HostStaging | None = None,
        prompt_counts: list[int] | None = None,
        position_offsets: list[int] | None = None,
    ) -> "StepBatch":
        """``rows`` in output order. ``logit_counts`` (optional, per row, 1 <= count <= the
        row's new tokens): how many of the row's last positions get logits; the forward then
        returns ``sum(logit_counts)`` rows, row by row, positions in order. ``row_adapters``:
        each row's LoRA adapter id (0 = base model), None = all base. Every row's block table
        must already cover ``start + len(new)`` tokens. ``prompt_counts`` (optional, per row): how
        many of the row's first new tokens are prompt tokens (quantized layers route them apart,
        and attention then takes each output token alone: ``PagedAttentionMetadata.prompt_counts``).
        ``position_offsets`` (optional, per row): added to the row's rotary positions (M-RoPE's
        delta after an image prompt); the cache slots still follow the tokens' indices.

        Every integer array of the step is packed into one host buffer (``staging``'s, pinned
        on CUDA; a fresh one when None) and reaches the device in one non-blocking copy; the
        batch's tensors are views of that one device tensor, with the dtypes the kernels read
        (int64 tokens/positions/indices/slots, int32 query starts, context lengths and block
        tables)."""
        tokens: list[int] = []
        positions: list[int] = []
        last_index: list[int] = []
        for row, (_, new, start) in enumerate(rows):
            tokens.extend(new)
            first = start + (position_offsets[row] if position_offsets else 0)
            positions.extend(range(first, first + len(new)))
            count = 1 if logit_counts is None else logit_counts[row]
            last_index.extend(range(len(tokens) - count, len(tokens)))
        tables = [list(table) for table, _, _ in rows]
        query_lens = [len(new) for _, new, _ in rows]
        context_lens = [start + len(new) for _, new, start in rows]
        slots, starts, width = host_layout(tables, query_lens, context_lens, block_size)
        lora_plan = _lora_plan(rows, row_adapters)
        lora_lists = [where for _, where in lora_plan or () if not isinstance(where, slice)]
        longs = [tokens, positions, last_index, slots, *lora_lists]
        padded_tables = [block for table in tables for block in table + [0] * (width - len(table))]
        ints = [starts, context_lens, padded_tables]
        long_views, int_views = _upload(longs, ints, staging, device)
        tokens_t, positions_t, last_index_t, slots_t, *lora_tensors = long_views
        starts_t, context_t, tables_t = int_views
        attn = PagedAttentionMetadata(
            slot_mapping=slots_t,
            query_start=starts_t,
            context_lens=context_t,
            block_tables=tables_t.view(len(rows), width),
            query_lens_host=query_lens,
            context_lens_host=context_lens,
            prompt_counts=tuple(prompt_counts) if prompt_counts is not None else None,
            # a lone row reads a view; a batch pads its rows into one gather anyway, so no scan of its tables
            block_runs_host=block_runs(tables, context_lens, block_size) if device.type == "cpu" and len(rows) == 1
            else None,
        )
        return StepBatch(
            tokens=tokens_t,
            positions=positions_t,
            last_index=last_index_t,
            attn=attn,
            logit_counts=logit_counts,
            lora=_lora_groups(lora_plan, lora_tensors),
            prompt_mask=_prompt_mask(rows, prompt_counts, device),
        )


def _prompt_mask(rows: list[Row], prompt_counts: list[int] | None, device: torch.device) -> torch.Tensor | None:
    if not prompt_counts or not any(prompt_counts):
        return None
    flags = [i < count for (_, new, _), count in zip(rows, prompt_counts, strict=True) for i in range(len(new))]
    return torch.tensor(flags, dtype=torch.bool, device=device)


def _upload(
    longs: list[list[int]], ints: list[list[int]], staging: HostStaging | None, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """int64 arrays then int32 arrays packed into one host buffer, each starting on a 16-byte
    boundary, copied in one go; returns the device views in order. Aligned views keep one
    Triton variant per kernel: Triton specialises a pointer on 16-byte alignment, and an
    unaligned block table compiled a second attention kernel inside a served step.
    Without ``staging``: a fresh buffer (pinned through torch's caching host allocator on CUDA)."""
    long_slots, int_slots = _aligned_sizes(longs, 2), _aligned_sizes(ints, 4)
    n_long, n_int = sum(long_slots), sum(int_slots)
    nbytes = 8 * n_long + 4 * n_int
    if staging is not None:
        host = staging.buffer(nbytes)
    else:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()
    _pack(raw[: 8 * n_long].view(np.int64), longs, long_slots)
    _pack(raw[8 * n_long : nbytes].view(np.int32), ints, int_slots)
    if staging is not None:
        flat = staging.upload(host)
    else:
        flat = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return (_split(flat[: 8 * n_long].view(torch.int64), longs, long_slots),
            _split(flat[8 * n_long : nbytes].view(torch.int32), ints, int_slots))


def _aligned_sizes(arrays: list[list[int]], per_16_bytes: int) -> list[int]:
    return [-(-len(values) // per_16_bytes) * per_16_bytes for values in arrays]


def _pack(out: np.ndarray, arrays: list[list[int]], sizes: list[int]) -> None:
    offset = 0
    for values, size in zip(arrays, sizes, strict=True):
        out[offset : offset + len(values)] = values
        offset += size


def _split(flat: torch.Tensor, arrays: list[list[int]], sizes: list[int]) -> list[torch.Tensor]:
    pieces = flat.split_with_sizes(sizes)
    return [piece if len(piece) == len(values) else piece[: len(values)]
            for piece, values in zip(pieces, arrays, strict=True)]


def _lora_plan(rows: list[Row], row_adapters: list[int] | None) -> list[tuple[int, slice | list[int]]] | None:
    if not row_adapters or not any(row_adapters):
        return None
    per_token = [adapter for (_, new, _), adapter in zip(rows, row_adapters, strict=True) for _ in new]
    return LoraGroups.plan(per_token)


def _lora_groups(plan, tensors: list[torch.Tensor]) -> LoraGroups | None:
    """The plan with its position lists replaced by their device views, in order."""
    if plan is None:
        return None
    remaining = iter(tensors)
    return LoraGroups(tuple((a, where if isinstance(where, slice) else next(remaining)) for a, where in plan))
