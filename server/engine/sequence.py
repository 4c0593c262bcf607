"""What the engine is asked to generate, and what it reports back per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sampler import SamplingParams, SamplingRow, TokenLogprobs
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass
class GenerationRequest:
    """One sequence to generate (the API layer submits ``n`` of these for ``n`` choices)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Callable[["SequenceDelta"], None]
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    matcher: Any = None  # constraints.Matcher (per sequence, never shared)
    token_dfa: Any = None  # constraints.TokenDFA for a device-resident mask, when enabled


@dataclass
class SequenceDelta:
    """What one sequence produced in one engine step."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def error_delta(request: GenerationRequest, message: str) -> SequenceDelta:
    """The final delta of a sequence that fails before it ever ran."""
    return SequenceDelta(
        text="", token_ids=[], logprobs=None, finish_reason="error",
        prompt_tokens=len(request.prompt_token_ids), error=message,
    )


@dataclass
class Sequence:
    """Engine-side state of one running sequence."""

    request: GenerationRequest
    row: SamplingRow
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    slot: int = -1
    cached_len: int = 0  # tokens whose keys/values are in the KV cache
    pending: list[int] = field(default_factory=list)  # tokens to feed the model next
    output_ids: list[int] = field(default_factory=list)
    closing: list[int] | None = None  # close_on_length: a completion that fits the budget left
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    aborted: bool = False
    closed: bool = False  # the final delta (with finish_reason) went to the sink
    # Collected during a step, flushed to the sink once per step.
    step_text: list[str] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason

    def fail(self, message: str) -> None:
        """End with finish_reason "error", replacing a finish of this step not yet reported."""
        self.finish_reason, self.stop_reason, self.error = "error", None, message

    def take_delta(self) -> SequenceDelta:
        """The step's output as one delta; resets the step buffers."""
        if self.finished:
            self.step_text.append(self.stops.flush())
        delta = SequenceDelta(
            text="".join(self.step_text),
            token_ids=self.step_tokens,
            logprobs=self.step_logprobs if self.request.params.logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=len(self.output_ids),
            error=self.error,
        )
        self.step_text, self.step_tokens, self.step_logprobs = [], [], []
        return delta
