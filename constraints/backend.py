"""The small interfaces every backend implements: Backend -> CompiledConstraint -> Matcher."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .spec import ConstraintSpec

if TYPE_CHECKING:
    import torch

    from .tokendfa import TokenDFA


@dataclass
class TokenizerContext:
    """What every backend needs to know about the tokenizer (shared, read-only)."""

    tokenizer: Any
    vocab_size: int  # logits width
    tokenizer_vocab: int  # ids >= this are never allowed
    stop_token_ids: tuple[int, ...]
    fingerprint: str
    cache: dict[str, Any] = field(default_factory=dict)  # per-backend tokenizer objects

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of ``text`` without special tokens."""
        backend = rust_tokenizer(self.tokenizer)
        if backend is not None:  # what transformers' encode calls, without its wrapper (a third of the time)
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        backend = rust_tokenizer(self.tokenizer)
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def rust_tokenizer(tokenizer: Any) -> Any:
    """A fast tokenizer's ``tokenizers.Tokenizer`` where transformers' encode/decode add nothing
    to its own (no clean-up of spaces after decoding), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend if hasattr(backend, "encode") and hasattr(backend, "decode") else None


class Matcher(ABC):
    """Per-sequence automaton state; never shared between sequences.

    A subclass whose library fills many rows at once may add a classmethod
    ``fill_bitmask_batch(matchers, bitmask, rows, threads)`` that writes ``bitmask[rows[i]]`` for
    ``matchers[i]`` exactly as ``fill_bitmask`` would; ``constraints.batch_fill`` then uses it.
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
        (see ``constraints.closing``): a valid completion, not always the shortest one.
        """
        from .closing import greedy_completion

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
        if int(torch.count_nonzero(mask)) > len(self.ctx.stop_token_ids):
            return []
        allowed = _bits_to_ids(mask[0])
        return allowed if allowed and set(allowed) <= set(self.ctx.stop_token_ids) else []


def _bits_to_ids(row: "torch.Tensor") -> list[int]:
    import torch

    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.reshape(-1)).flatten().tolist()


class CompiledConstraint(ABC):
    """A compiled, immutable automaton; ``new_matcher()`` gives per-sequence state."""

    spec: ConstraintSpec
    backend: str

    @abstractmethod
    def new_matcher(self) -> Matcher:
        """A fresh matcher in the initial state."""

    def token_dfa(self) -> "TokenDFA | None":
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


def make_backend(name: str, ctx: TokenizerContext) -> Backend:
    """The backend called ``name`` for ``ctx``'s tokenizer."""
    if name == "xgrammar":
        from .backend_xgrammar import XGrammarBackend

        return XGrammarBackend(ctx)
    if name == "llguidance":
        from .backend_llguidance import LLGuidanceBackend

        return LLGuidanceBackend(ctx)
    if name == "outlines":
        from .backend_outlines import OutlinesBackend

        return OutlinesBackend(ctx)
    from .errors import UnsupportedConstraintError

    raise UnsupportedConstraintError(f"unknown backend {name!r}")


BackendFactory = Callable[[TokenizerContext], Backend]
