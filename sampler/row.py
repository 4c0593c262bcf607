"""Per-sequence sampling state."""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sampler.dfa import DeviceDFA
from sampler.params import SamplingParams

if TYPE_CHECKING:
    from sampler.pool import PenaltyPool


class SamplingRow:
    """One sequence's sampling state; create with ``Sampler.new_row``.

    Attributes:
        params: the request's :class:`SamplingParams`.
        output_token_ids: every token appended so far (sampled or forced).
        dfa: the attached :class:`DeviceDFA`, or None.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        device: torch.device,
        pool: PenaltyPool | None,
        choice_index: int = 0,
    ) -> None:
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.dfa: DeviceDFA | None = None
        self.device = device
        self.version = 0  # bumped when the constraint set changes (invalidates batch plans)
        seed = params.seed
        if seed is not None and choice_index:
            seed = f"{seed}:{choice_index}"  # str seeds are hashed deterministically
        self.rng = random.Random(seed)  # seed None -> OS entropy
        self.slot: int | None = None
        self.pending_counts: list[int] = []
        if pool is not None and params.has_penalties:
            self.slot = pool.allocate(prompt_token_ids)
            self._finalizer = weakref.finalize(self, pool.release, self.slot)

    def append_token(self, token_id: int) -> None:
        """Record a token added to the sequence (sampled or forced, e.g. jump-forward).

        Penalty counts and the DFA state are updated lazily, batched, at the next
        ``Sampler.sample`` call (or when ``dfa.state`` is read).
        """
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if self.slot is not None:
            self.pending_counts.append(token_id)
        if self.dfa is not None:
            self.dfa.push(token_id)

    def attach_dfa(self, dfa: DeviceDFA | Any) -> DeviceDFA:
        """Constrain this row by a DFA (a ``DeviceDFA``, or a ``TokenDFA``-like object that is
        converted on this row's device with cached tables). A ``DeviceDFA`` already attached
        to another row is forked, so rows never share state. Returns the attached DFA."""
        if not isinstance(dfa, DeviceDFA):
            dfa = DeviceDFA(dfa, self.device)
        if dfa.tables.device != self.device:
            raise ValueError(f"DFA tables live on {dfa.tables.device}, sampler on {self.device}")
        if dfa._owner is not None and dfa._owner() not in (None, self):
            dfa = dfa.fork()
        dfa._owner = weakref.ref(self)
        self.dfa = dfa
        self.version += 1
        return dfa

    def detach_dfa(self) -> None:
        """Remove the DFA constraint."""
        self.dfa = None
        self.version += 1

    @property
    def num_generated(self) -> int:
        """Number of tokens appended so far."""
        return len(self.output_token_ids)

    def release(self) -> None:
        """Free device penalty state now (otherwise freed when the row is garbage-collected)."""
        if self.slot is not None:
            self._finalizer()
            self.slot = None
            self.pending_counts.clear()
            self.version += 1
