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
        self.top_p = params.top_p  # this step's top-p (decays when params.decays_top_p)
        longest = max((len(w) for w in params.bad_words), default=1)
        self._bad_context = list(prompt_token_ids[max(0, len(prompt_token_ids) - (longest - 1)):]) if longest > 1 else []
        # Only a client logit processor reads the whole prompt (as ``__req__.origin_input_ids``).
        self.prompt_token_ids = list(prompt_token_ids) if params.custom_processor is not None else None
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
        if self.params.decays_top_p:
            self._decay_top_p(token_id)

    def _decay_top_p(self, token_id: int) -> None:
        params = self.params
        if token_id in params.top_p_reset_ids:
            self.top_p = params.top_p
        else:
            self.top_p = max(self.top_p * params.top_p_decay, params.top_p_min)

    def banned_words_now(self) -> list[int]:
        """Tokens that would complete one of ``params.bad_words`` after the tokens so far
        (the prompt's last tokens count as context too)."""
        banned = []
        for word in self.params.bad_words:
            head = len(word) - 1
            if head == 0:
                banned.append(word[0])
                continue
            if self._context_ends_with(word[:-1]):
                banned.append(word[-1])
        return banned

    def _context_ends_with(self, head: tuple[int, ...]) -> bool:
        n = len(head)
        out = self.output_token_ids
        if len(out) >= n:
            return tuple(out[len(out) - n:]) == head
        need = n - len(out)
        if len(self._bad_context) < need:
            return False
        return tuple(self._bad_context[len(self._bad_context) - need:]) + tuple(out) == head

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
