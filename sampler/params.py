"""Sampling parameters and results (the engine-facing data types)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # reported instead of -inf (OpenAI's convention for impossible tokens)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    Invalid values raise ``ValueError`` at construction. ``logit_bias`` keys may be ints or
    decimal strings (as in OpenAI JSON); they are normalised to an immutable ``{int: float}``.
    ``top_k <= 0`` means off.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    banned_until_min_tokens: frozenset[int] = frozenset()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        object.__setattr__(self, "banned_until_min_tokens", frozenset(int(t) for t in self.banned_until_min_tokens))
        if self.logit_bias is not None:
            bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if any(not -100.0 <= v <= 100.0 for v in bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
            object.__setattr__(self, "logit_bias", MappingProxyType(bias) if bias else None)

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax of the processed logits."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Any of repetition / presence / frequency penalty is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and the ``top_logprobs`` best alternatives.

    Values come from the distribution actually sampled from (after masks, penalties,
    temperature, top-k/top-p/min-p; greedy rows: log_softmax of the processed logits).
    ``-inf`` is reported as ``LOGPROB_FLOOR`` (-9999.0). ``top`` is sorted descending.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SampleResult:
    """One sampled token per row (batch order), and logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
