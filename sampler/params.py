"""Sampling parameters and results (the engine-facing data types)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # reported instead of -inf (OpenAI's convention for impossible tokens)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    Invalid values raise ``ValueError`` at construction. ``logit_bias`` keys may be ints or
    decimal strings (as in OpenAI JSON); they are normalised to an immutable ``{int: float}``.
    ``top_k <= 0`` means off.

    ``bad_words``: token sequences never generated (TensorRT-LLM's bad words): the last token of
    a sequence is banned whenever the tokens before it (prompt included) end with the rest of it;
    a one-token sequence is a banned token. ``top_p_decay`` / ``top_p_min`` / ``top_p_reset_ids``:
    TensorRT-LLM's decaying top-p: after each token the row's top-p becomes
    ``max(top_p * top_p_decay, top_p_min)``, or ``top_p`` again when the token is a reset id.
    ``custom_processor`` / ``custom_params``: a client logit processor (SGLang's contract, see
    :mod:`sampler.custom`) run on the raw logits before every other step, and its per-request params.
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
    bad_words: tuple[tuple[int, ...], ...] = ()
    top_p_decay: float = 1.0
    top_p_min: float = 1e-6
    top_p_reset_ids: frozenset[int] = frozenset()
    custom_processor: Callable[..., Any] | None = None
    custom_params: Mapping[str, Any] | None = None

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
        if not 0.0 < self.top_p_decay <= 1.0:
            raise ValueError(f"top_p_decay must be in (0, 1], got {self.top_p_decay}")
        if not 0.0 < self.top_p_min <= 1.0:
            raise ValueError(f"top_p_min must be in (0, 1], got {self.top_p_min}")
        words = tuple(tuple(int(t) for t in word) for word in self.bad_words)
        if any(not word for word in words):
            raise ValueError("bad_words entries must not be empty")
        object.__setattr__(self, "bad_words", words)
        object.__setattr__(self, "top_p_reset_ids", frozenset(int(t) for t in self.top_p_reset_ids))
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
    def decays_top_p(self) -> bool:
        """Top-p changes from token to token (TensorRT-LLM's decaying top-p)."""
        return self.top_p_decay < 1.0 and not self.greedy

    @property
    def uses_top_p(self) -> bool:
        """Top-p truncation applies to this (sampled) row."""
        return not self.greedy and (self.top_p < 1.0 or self.decays_top_p)

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
    """One sampled token per row (batch order), and logprobs where the row asked for them.

    ``failures``: rows whose own processing failed (a client logit processor); the engine ends
    those sequences with the message, and their ``token_ids`` entry means nothing."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failures: dict[int, str] = field(default_factory=dict)  # row → why it failed (its token is void)


@dataclass
class PendingSample:
    """A sampler pass whose ids (and logprobs) are on their way to the host.

    ``ids`` [B] int64 stays on the device (the next step's inputs can be gathered from it
    without the host); ``host`` is filled by a non-blocking copy, so :meth:`result` may be read
    only once that copy is known to be done (a device event recorded after the pass, or at once
    on the CPU)."""

    ids: torch.Tensor
    host: torch.Tensor
    decode: Callable[[torch.Tensor], SampleResult]
    failures: dict[int, str] = field(default_factory=dict)

    def result(self) -> SampleResult:
        result = self.decode(self.host)
        result.failures.update(self.failures)
        return result

    def result_now(self) -> SampleResult:
        """:meth:`result`, waiting for the device first (the pass's one host sync)."""
        if self.ids.device.type == "cuda":
            torch.cuda.current_stream(self.ids.device).synchronize()
        return self.result()


def read_back(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` on the host: a non-blocking copy into pinned memory from CUDA, as is elsewhere."""
    if packed.device.type != "cuda":
        return packed
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    return host

