"""One engine step flattened for the model runner: every row's new tokens back to back.

A row is one sequence this step: its block table (physical KV blocks in order), its new tokens
(one for a decoding row, several for a prefill chunk, a jump-forward continuation, a draft or a
scored choice) and how many of its tokens the cache already holds. The runner writes the new
tokens' keys/values into the row's blocks and attends over the row's whole context in one
attention call per layer (:mod:`kernels.paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import PagedAttentionMetadata
from server.engine.lora import LoraGroups

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
    ) -> "StepBatch":
        """``rows`` in output order. ``logit_counts`` (optional, per row, 1 <= count <= the
        row's new tokens): how many of the row's last positions get logits; the forward then
        returns ``sum(logit_counts)`` rows, row by row, positions in order. ``row_adapters``:
        each row's LoRA adapter id (0 = base model), None = all base. Every row's block table
        must already cover ``start + len(new)`` tokens."""
        tokens: list[int] = []
        positions: list[int] = []
        last_index: list[int] = []
        for row, (_, new, start) in enumerate(rows):
            tokens.extend(new)
            positions.extend(range(start, start + len(new)))
            count = 1 if logit_counts is None else logit_counts[row]
            last_index.extend(range(len(tokens) - count, len(tokens)))
        attn = PagedAttentionMetadata.build(
            [list(table) for table, _, _ in rows],
            [len(new) for _, new, _ in rows],
            [start + len(new) for _, new, start in rows],
            block_size,
            device,
        )
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return StepBatch(
            tokens=as_long(tokens),
            positions=as_long(positions),
            last_index=as_long(last_index),
            attn=attn,
            logit_counts=logit_counts,
            lora=_lora_groups(rows, row_adapters, device),
        )


def _lora_groups(rows: list[Row], row_adapters: list[int] | None, device: torch.device) -> LoraGroups | None:
    if not row_adapters or not any(row_adapters):
        return None
    per_token = [adapter for (_, new, _), adapter in zip(rows, row_adapters, strict=True) for _ in new]
    return LoraGroups.build(per_token, device)
