"""What the engine is asked to generate, and what it reports back per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sampler import SamplingParams, SamplingRow, TokenLogprobs
from server.engine.block_manager import BlockTable
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.speculation import Speculator


SAMPLED = -1  # a sampled token still on the device (overlapped loop; no real token id is negative)


@dataclass(frozen=True)
class ReasoningPhase:
    """A reasoning segment before the (constrained) answer: "free to think, strict to answer".

    While the sequence is inside the segment its constraint is not consulted (no mask, no
    accept, no jump-forward, no termination). The segment ends when the output ends with
    ``end_ids``, or is ended by the engine (``end_ids`` forced) once ``budget`` reasoning tokens
    were generated, or when the model samples EOS while an answer is still required. Then
    ``answer_prefix_ids`` are forced (harmony's final-channel header) and the constraint starts
    fresh on the tokens that follow.
    """

    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()  # forced first when the prompt does not open the segment
    answer_prefix_ids: tuple[int, ...] = ()
    budget: int | None = None  # reasoning tokens (markers not counted); None = bounded by max_tokens
    #: The end marker as text, where the tokenizer has no single token for it: the model may then
    #: write it in other tokens than ``end_ids`` (or end it inside a longer token), so the decoded
    #: output is matched too.
    end_text: str = ""

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("a reasoning phase needs an end marker")
        if self.budget is not None and self.budget < 0:
            raise ValueError("a reasoning budget cannot be negative")


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
    spaces_between_special_tokens: bool = False
    stop_regex: tuple[Any, ...] = ()  # compiled ``regex`` patterns
    matcher: Any = None  # constraints.Matcher (per sequence, never shared)
    token_dfa: Any = None  # constraints.TokenDFA for a device-resident mask, when enabled
    reasoning: ReasoningPhase | None = None  # the constraint applies after this segment
    prediction_token_ids: list[int] | None = None  # predicted output (a draft to verify)
    speculation: bool = True  # prompt-lookup drafts allowed (the server's --speculation permitting)
    score_choices: list[list[int]] | None = None  # choices' token ids: score all, emit one
    adapter: int = 0  # LoRA adapter id (0 = the base model)
    return_hidden_states: bool = False  # report each output token's last-layer hidden state
    service_tier: str = "default"  # priority | default | flex: order of admission to the batch
    media: Any = None  # server.engine.vision.PromptMedia: the prompt's images (vision-language models)


@dataclass
class SequenceDelta:
    """What one sequence produced in one engine step."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None  # SGLang's: the stop string/regex text or token id (EOS too)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    accepted_prediction_tokens: int = 0  # running totals (predicted outputs)
    rejected_prediction_tokens: int = 0
    accepted_draft_tokens: int = 0  # running totals (the engine's own drafts: prompt lookup)
    rejected_draft_tokens: int = 0
    choice_logprobs: list[float] | None = None  # per choice, normalised (choice scoring)
    hidden_states: list[list[float]] | None = None  # per token of this delta, when asked for


def error_delta(request: GenerationRequest, message: str) -> SequenceDelta:
    """The final delta of a sequence that fails before it ever ran."""
    return SequenceDelta(
        text="", token_ids=[], logprobs=None, finish_reason="error",
        prompt_tokens=len(request.prompt_token_ids), error=message,
    )


@dataclass
class ChoiceScores:
    """A choice request's scores (:mod:`server.engine.scoring`): every choice is scored as a
    whole before one is emitted."""

    sums: list[float | None]  # raw sum of each choice's token logprobs (None: not scored yet)
    token_logprobs: list[Any]  # per choice: its tokens' TokenLogprobs
    normalised: list[float] | None = None  # per choice, once every choice is scored

    @classmethod
    def for_choices(cls, count: int) -> "ChoiceScores":
        return cls([None] * count, [None] * count)

    @property
    def complete(self) -> bool:
        return all(score is not None for score in self.sums)


@dataclass(eq=False)  # identity: the batch lists look sequences up by object, never by value
class Sequence:
    """Engine-side state of one running sequence."""

    request: GenerationRequest
    row: SamplingRow
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    matcher: Any = None  # the constraint in force: None while reasoning, then request.matcher
    reasoning: ReasoningPhase | None = None  # set while the sequence is inside its reasoning segment
    reasoning_tokens: int = 0  # tokens generated inside the segment (markers not counted)
    table: BlockTable = field(default_factory=BlockTable)  # KV blocks and the tokens cached in them
    admitted: bool = False  # joined the running batch at least once
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    pending: list[int] = field(default_factory=list)  # tokens to feed the model next
    output_ids: list[int] = field(default_factory=list)
    closing: list[int] | None = None  # close_on_length: a completion that fits the budget left
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    eos_hit: int | None = None  # the EOS token that ended the sequence
    error: str | None = None
    aborted: bool = False
    closed: bool = False  # the final delta (with finish_reason) went to the sink
    draft: Speculator | None = None  # where its drafts come from (prediction, prompt lookup)
    verify: list[int] = field(default_factory=list)  # draft tokens fed this step
    verify_logits: Any = None  # [len(verify), V] logits after each of them
    choices: ChoiceScores | None = None  # a choice request's scores (choice scoring)
    # Collected during a step, flushed to the sink once per step.
    step_text: list[str] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_logprobs: list[TokenLogprobs] = field(default_factory=list)
    step_hidden: list[list[float]] = field(default_factory=list)

    @property
    def ends_with_sampled(self) -> bool:
        """Its token still on the device is its last by its budget (overlapped loop): nothing
        is fed after it."""
        return self.pending == [SAMPLED] and len(self.output_ids) + 1 >= self.request.max_tokens

    @property
    def scoring(self) -> bool:
        """Choices are still being scored: no token is emitted before one is picked."""
        return self.choices is not None and self.choices.normalised is None

    @property
    def cached_len(self) -> int:
        """Tokens whose keys/values are in the KV cache."""
        return self.table.num_tokens

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
            matched_stop=self._matched_stop(),
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            error=self.error,
            accepted_prediction_tokens=self.draft.accepted if self.draft else 0,
            rejected_prediction_tokens=self.draft.rejected if self.draft else 0,
            accepted_draft_tokens=self.draft.lookup_accepted if self.draft else 0,
            rejected_draft_tokens=self.draft.lookup_rejected if self.draft else 0,
            choice_logprobs=self.choices.normalised if self.choices is not None else None,
            hidden_states=self.step_hidden if self.request.return_hidden_states else None,
        )
        self.step_text, self.step_tokens, self.step_logprobs, self.step_hidden = [], [], [], []
        return delta

    def _matched_stop(self) -> int | str | None:
        if self.finish_reason != "stop":
            return None
        return self.stop_reason if self.stop_reason is not None else self.eos_hit
