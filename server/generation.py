"""Bridge between the asyncio handlers and the engine thread.

A :class:`GenerationStream` submits the sequences of one API request and yields their deltas
as ``(choice_index, SequenceDelta)`` in arrival order; closing it aborts whatever still runs.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from sampler import SamplingParams, TokenLogprobs
from sampler.custom import ERROR_PREFIX
from server.engine.engine import CONSTRAINT_LIMIT, CONSTRAINT_TIMEOUT, Engine
from server.engine.sequence import GenerationRequest, SequenceDelta
from server.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choices of one request get distinct but reproducible seeds."""
    if seed is None:
        return None
    return (seed + index * 0x9E3779B1) % (1 << 63)


@dataclass
class GenerationTiming:
    """When a request's tokens arrived, for TTFT/TPOT metrics and the request log."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def saw(self, new_tokens: int) -> None:
        if not new_tokens:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += new_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


class GenerationStream:
    """Submits sequences to the engine and iterates their deltas until all have finished."""

    def __init__(self, engine: Engine, request_id: str, on_close: Callable[[GenerationTiming], None] | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.timing = GenerationTiming()
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, SequenceDelta]] = asyncio.Queue()
        self._open = 0
        self._closed = False

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Queue every sequence of the request at once, each reporting to this stream
        (EngineOverloaded: none was queued)."""
        for index, request in enumerate(requests):
            request.sink = self._sink(index)
        self.engine.submit_all(requests)
        self._open += len(requests)

    def _sink(self, index: int) -> Callable[[SequenceDelta], None]:
        def deliver(delta: SequenceDelta) -> None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, delta))
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        return deliver

    async def __aiter__(self) -> AsyncIterator[tuple[int, SequenceDelta]]:
        while self._open:
            index, delta = await self._queue.get()
            if delta.finish_reason is not None:
                self._open -= 1
            self.timing.saw(len(delta.token_ids))
            yield index, delta

    def close(self) -> None:
        """Abort sequences still running (client gone, error elsewhere)."""
        if self._closed:
            return
        if self._open:
            self.engine.abort(self.request_id)
        self._closed = True
        if self._on_close is not None:
            self._on_close(self.timing)


def unsubmitted(delta: SequenceDelta) -> None:
    """The sink of a request before :meth:`GenerationStream.submit` gives it the stream's own."""
    raise RuntimeError("a GenerationRequest reported before it was submitted")


def start_generation(engine: Engine, request_id: str, requests: list[GenerationRequest],
                     on_close: Callable[[GenerationTiming], None] | None = None) -> GenerationStream:
    """Submit one API request's sequences, built whole by the request pipeline; ``on_close``
    gets the request's :class:`GenerationTiming` when the stream closes."""
    stream = GenerationStream(engine, request_id, on_close)
    stream.submit(requests)
    return stream


@dataclass
class ChoiceResult:
    """Everything one choice produced, for a non-streamed response."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    accepted_draft_tokens: int = 0  # the engine's own drafts (prompt lookup)
    rejected_draft_tokens: int = 0
    choice_logprobs: list[float] | None = None
    hidden_states: list[list[float]] = field(default_factory=list)

    def add(self, delta: SequenceDelta) -> None:
        """Fold one engine delta of this choice in."""
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or ())
        self.hidden_states.extend(delta.hidden_states or ())
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        self.accepted_prediction_tokens = delta.accepted_prediction_tokens
        self.rejected_prediction_tokens = delta.rejected_prediction_tokens
        self.accepted_draft_tokens = delta.accepted_draft_tokens
        self.rejected_draft_tokens = delta.rejected_draft_tokens
        self.choice_logprobs = delta.choice_logprobs or self.choice_logprobs
        if delta.finish_reason:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.matched_stop = delta.matched_stop


def generation_error(message: str):
    """A failed generation as the client sees it: its own logit processor failing, or its
    constraint hitting a parser limit or not answering in time, is a 400 naming the cause;
    anything else a 500."""
    from server.errors import APIError

    if message.startswith(ERROR_PREFIX):
        return APIError(message, status=400, param="custom_logit_processor", code="custom_logit_processor_failed")
    if message.startswith(CONSTRAINT_LIMIT):
        return APIError(f"{message}; a simpler schema or grammar avoids it", status=400, code="constraint_limit")
    if message.startswith(CONSTRAINT_TIMEOUT):
        return APIError(message, status=400, code="constraint_timeout")
    return APIError(message, status=500, code="generation_error")


async def collect(stream: GenerationStream, n_choices: int) -> list[ChoiceResult]:
    """Drain ``stream`` into per-choice results; a failed generation becomes an APIError (500, or
    400 when the request's own ``custom_logit_processor`` failed)."""
    results = [ChoiceResult() for _ in range(n_choices)]
    try:
        async for index, delta in stream:
            if delta.finish_reason == "error":
                raise generation_error(delta.error or "generation failed")
            results[index].add(delta)
    finally:
        stream.close()
    return results


def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    return replace(params, seed=choice_seed(params.seed, index))


# --------------------------------------------------------------------------- logprobs formatting


class TokenTexts:
    """Per-token display text and bytes for logprobs, cached by id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            hit = (text, list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit

    def chat_entries(self, logprobs: list[TokenLogprobs]) -> list[TokenLogprob]:
        return [self._chat_entry(entry) for entry in logprobs]

    def _chat_entry(self, entry: TokenLogprobs) -> TokenLogprob:
        text, raw = self.get(entry.token_id)
        top = [TopLogprob(token=self.get(t)[0], logprob=lp, bytes=self.get(t)[1]) for t, lp in entry.top]
        return TokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)

    def completion_logprobs(self, logprobs: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        tokens, values, tops, offsets = [], [], [], []
        for entry in logprobs:
            text = self.get(entry.token_id)[0]
            tokens.append(text)
            values.append(entry.logprob)
            tops.append({self.get(t)[0]: lp for t, lp in entry.top} if entry.top else None)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)
