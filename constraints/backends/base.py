"""The small interfaces every backend implements: Backend -> CompiledConstraint -> Matcher, and
the TokenDFA a compiled constraint may hand GPU kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..spec import ConstraintSpec
from .closing import greedy_completion
from .vocabulary import TokenizerContext

if TYPE_CHECKING:
    import torch


class Matcher(ABC):
    """Per-sequence automaton state; never shared between sequences.

    A subclass whose library fills many rows at once may add a classmethod
    ``fill_bitmask_batch(matchers, bitmask, rows, threads)`` that writes ``bitmask[rows[i]]`` for
    ``matchers[i]`` exactly as ``fill_bitmask`` would; ``constraints.backends.batch_fill`` then
    uses it.
    """

    ctx: TokenizerContext
    close_on_length: bool = False  # set per sequence: the engine closes the output within budget

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the token is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]``."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state."""

    def forced_text(self) -> str:
        """Text every continuation starts with (backend hook; '' when none)."""
        return ""

    def shortest_completion(self, limit: int) -> list[int] | None:
        """Tokens that complete the output from the current state (the final stop token not
        included), at most ``limit`` of them, or None when none is found within ``limit``.

        The state is left unchanged. The default walks the automaton greedily towards closing
        (see ``constraints.backends.closing``): a valid completion, not always the shortest one.
        """
        return greedy_completion(self, limit)

    def forced_tokens(self) -> list[int]:
        """Tokens the automaton forces next, tokenized canonically; [] when nothing is forced.

        The forced text is tokenized as the model's tokenizer would; the final token is dropped
        (it might merge with what follows) unless the forced text completes the output.
        Only a prefix of tokens that the matcher accepts one by one is returned.
        """
        if self.is_terminated():
            return []
        text = self.forced_text()
        if not text:
            stops = self._allowed_if_only_stops()
            return stops if len(stops) == 1 else []
        ids = self.ctx.encode(text)
        if self.ctx.decode(ids) != text:
            return []
        accepted = self._accept_prefix(ids)
        ends_output = accepted == len(ids) and self._only_stop_allowed()
        self.rollback(accepted)
        if accepted < len(ids):
            ids = ids[:accepted]
        if not ends_output and ids:
            ids = ids[:-1]
        return ids

    def accept_forced(self, ids: Sequence[int]) -> int:
        """Take a run of tokens :meth:`forced_tokens` returned, as far as they are accepted;
        returns how many were taken (a backend may check the run at once, without a mask per
        token: these tokens are appended, never sampled)."""
        return self._accept_prefix(ids)

    def valid_prefix(self, ids: Sequence[int]) -> int:
        """How many of ``ids``, from the current state, the matcher would take in a row; the
        state is left unchanged (drafts are checked before they are fed)."""
        taken = self._accept_prefix(ids)
        self.rollback(taken)
        return taken

    def _accept_prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for t in ids:
            if not self.accept_token(t):
                break
            n += 1
        return n

    def _only_stop_allowed(self) -> bool:
        return bool(self._allowed_if_only_stops())

    def _allowed_if_only_stops(self) -> list[int]:
        """The allowed stop tokens when nothing but stop tokens is allowed, else []."""
        import torch

        words = (self.ctx.vocab_size + 31) // 32
        mask = torch.zeros((1, words), dtype=torch.int32)
        self.fill_bitmask(mask, 0)
        allowed = _bits_to_ids(mask[0], limit=len(self.ctx.stop_token_ids))
        return allowed if allowed and set(allowed) <= set(self.ctx.stop_token_ids) else []


def _bits_to_ids(row: "torch.Tensor", limit: int) -> list[int]:
    """The set bits of a bitmask row as token ids, [] when more than ``limit`` are set."""
    # numpy, not torch: this runs beside the forward (on the engine's bounded-call worker), and
    # a torch op over the vocabulary's bits would start an OpenMP team of that thread's own,
    # after which every team on this machine's cores waits by sleeping instead of spinning
    import numpy as np

    ids = np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))
    return ids.tolist() if len(ids) <= limit else []


@dataclass
class TokenDFA:
    """Token-level DFA. States are 0..S-1.

    ``allowed[s]`` is the int32 bitmask of state s (stop tokens set in final states);
    transitions are CSR: tokens ``trans_tokens[trans_offsets[s]:trans_offsets[s+1]]`` (sorted)
    lead to ``trans_next`` at the same positions. Stop tokens have no transition.
    """

    initial_state: int
    allowed: "torch.Tensor"  # int32 [S, W]
    trans_offsets: "torch.Tensor"  # int32 [S+1]
    trans_tokens: "torch.Tensor"  # int32 [E]
    trans_next: "torch.Tensor"  # int32 [E]
    final: "torch.Tensor"  # bool [S]
    stop_token_ids: tuple[int, ...]

    @property
    def num_states(self) -> int:
        return int(self.final.shape[0])


class CompiledConstraint(ABC):
    """A compiled, immutable automaton; ``new_matcher()`` gives per-sequence state."""

    spec: ConstraintSpec
    backend: str

    @abstractmethod
    def new_matcher(self) -> Matcher:
        """A fresh matcher in the initial state."""

    def token_dfa(self) -> TokenDFA | None:
        """A token-level DFA for GPU kernels, when this backend has one within budget."""
        return None

    def size_bytes(self) -> int:
        """Estimated memory held (for the cache budget)."""
        return 4096


class Backend(ABC):
    """Compiles specs of the kinds it supports; stateless besides tokenizer caches.

    ``compile`` runs in a compile worker process (its cost may be unbounded) and returns a
    picklable payload; ``load`` turns that payload into a CompiledConstraint in the server
    process, with work bounded by the payload's size.
    """

    name: str

    def __init__(self, ctx: TokenizerContext) -> None:
        self.ctx = ctx

    def prepare(self) -> None:
        """Build the per-tokenizer tables ``compile`` needs (once per worker, outside budgets)."""

    @abstractmethod
    def compile(self, spec: ConstraintSpec, source: Any) -> Any:
        """Compile ``source`` (``spec.source`` after analysis/rewriting) into a payload, or raise
        ConstraintError."""

    @abstractmethod
    def load(self, spec: ConstraintSpec, payload: Any) -> CompiledConstraint:
        """The compiled constraint for a payload ``compile`` returned."""
