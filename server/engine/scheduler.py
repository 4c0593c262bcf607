"""Which sequences run this step, what each one feeds, and where its keys/values go.

Sequences wait in arrival order (by service tier), join the running batch while the batch has
room and the KV cache has blocks for their tokens (a cached prefix costs nothing), and feed their
pending tokens: one for a decoding sequence, a prefill chunk within the step's token budget, or a
continuation (jump-forward, forced markers). When a running sequence needs a block and none is
free, the newest running sequence is preempted: its blocks go back (their full ones stay cached)
and it waits at the front of the queue to recompute what it lost, so no request fails for lack of
blocks as long as it fits in the cache alone.
"""

from __future__ import annotations

import logging

from server.engine.block_manager import BlockManager
from server.engine.sequence import Sequence

log = logging.getLogger("trellis.engine")

_TIER_RANK = {"priority": 0, "default": 1, "auto": 1, "flex": 2}


class Scheduler:
    """Owns the waiting queue and the running batch (admission order, oldest first)."""

    def __init__(self, blocks: BlockManager, max_batch_size: int, prefill_budget: int, chunk_multiple: int = 1) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.prefill_budget = prefill_budget
        # a cut prompt ends at a multiple of this many cached tokens (a batch-invariant runner: its
        # prompt attention then runs the same calls whatever else shares the step)
        self.chunk_multiple = chunk_multiple
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    def admit(self) -> tuple[list[int], list[Sequence]]:
        """Move waiting sequences into the batch while it has room and the cache has blocks.

        Returns the prompt lengths of sequences admitted for the first time (for admission
        control) and the sequences that can never fit (more tokens than the whole cache)."""
        admitted: list[int] = []
        too_long: list[Sequence] = []
        if len(self.running) < self.max_batch_size and len(self.waiting) > 1:
            self.waiting.sort(key=_admission_rank)  # stable: arrival order within a tier
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if len(seq.pending) > self.blocks.capacity_tokens:
                too_long.append(self.waiting.pop(0))
                continue
            if not self.blocks.admit(seq.table, seq.pending, reserve=len(self.running)):
                if self.running:
                    break  # wait for blocks to come back
                if not self.blocks.admit(seq.table, seq.pending):
                    break
            self.waiting.pop(0)
            del seq.pending[: seq.table.num_tokens]
            if not seq.admitted:
                seq.admitted = True
                seq.cached_tokens = seq.table.reused_tokens
                admitted.append(len(seq.request.prompt_token_ids))
            self.running.append(seq)
        return admitted, too_long

    def schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Split live sequences into one-token decode rows and (sequence, n_tokens) extensions,
        each with blocks for what it feeds (preempting the newest sequences when blocks run out)."""
        decode_rows: list[Sequence] = []
        extend_plan: list[tuple[Sequence, int]] = []
        budget = self.prefill_budget
        for seq in list(self.running):
            if seq not in self.running or seq.finished or seq.ends_with_sampled:
                continue  # preempted by an older sequence of this step, or done
            if seq.scoring and not seq.pending:
                continue  # its choices are scored instead (see server.engine.scoring)
            if len(seq.pending) == 1 and not seq.scoring:
                take = 1
            elif budget > 0 or not extend_plan:
                take = min(len(seq.pending), max(budget, 1))
                if take < len(seq.pending) and seq.request.media is not None:
                    take = seq.request.media.whole_runs(seq.cached_len, take)  # Gemma 3: whole images
                if take < len(seq.pending) and self.chunk_multiple > 1:
                    take = self._aligned_cut(seq.cached_len, take, not extend_plan)
                    if take == 0:
                        continue
            else:
                continue
            if not self._make_room(seq, seq.cached_len + take):
                continue  # it was itself the newest: preempted
            if take == 1 and len(seq.pending) == 1 and not seq.scoring:
                decode_rows.append(seq)
            else:
                extend_plan.append((seq, take))
                budget -= take
        return decode_rows, extend_plan

    def _aligned_cut(self, cached: int, take: int, must_progress: bool) -> int:
        """``take`` shortened so the cut falls on a multiple of :attr:`chunk_multiple` cached
        tokens; 0 when none is within reach (then the next boundary if the step has nothing else)."""
        multiple = self.chunk_multiple
        aligned = (cached + take) // multiple * multiple - cached
        if aligned > 0:
            return aligned
        return (cached // multiple + 1) * multiple - cached if must_progress else 0

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` cached tokens without preempting anyone (drafts)."""
        return self.blocks.ensure(seq.table, num_tokens)

    def release(self, seq: Sequence) -> None:
        """A finished sequence leaves the batch; its blocks go back (full ones stay cached)."""
        self.running.remove(seq)
        self.blocks.free(seq.table)

    def release_all(self) -> list[Sequence]:
        running, self.running = self.running, []
        for seq in running:
            self.blocks.free(seq.table)
        return running

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        while not self.blocks.ensure(seq.table, num_tokens):
            victim = next((s for s in reversed(self.running) if not s.finished), seq)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks back; it waits first in line to recompute its cached tokens."""
        log.info("preempting %s (%d cached tokens): KV cache full", seq.request.request_id, seq.cached_len)
        self.preemptions += 1
        self.running.remove(seq)
        seq.pending = seq.table.tokens + seq.pending
        self.blocks.free(seq.table)
        self.waiting.insert(0, seq)


def _admission_rank(seq: Sequence) -> tuple[int, int]:
    """Preempted sequences first, then priority before default/auto, flex only when neither waits."""
    return (0 if seq.admitted else 1, _TIER_RANK.get(seq.request.service_tier, 1))
