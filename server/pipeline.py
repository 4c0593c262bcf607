"""The request pipeline of ``/v1/chat/completions`` and ``/v1/completions`` (and their ``/v0`` routes).

An endpoint takes these steps in its own order: :func:`decode` and :func:`admit` the request,
:func:`settle_sampling` (stop strings are parsed here, once), make prompt token ids (its own step:
rendered messages or raw prompts) and :func:`truncate_prompts`, compile the :func:`constraint`, and
build one engine :class:`GenerationRequest` per choice (:func:`sequences`). The job then runs to
the end (:func:`collect_choices`) or streams (:meth:`ChunkWriter.events`: one SSE skeleton around
the endpoint's chunks). The endpoints keep what differs: the prompt and the response shape.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from sampler import SamplingParams
from server.engine.sequence import GenerationRequest, SequenceDelta
from server.engine_options import adapter_id, adapter_in_model, apply_engine_options, response_model, response_tier
from server.errors import APIError
from server.generation import ChoiceResult, GenerationStream, collect, generation_error, unsubmitted, with_seed
from server.protocol import ChatCompletionRequest, ChoiceLogprob, CompletionRequest, Usage
from server.requests import check_scoring_without_processor, choice_token_ids, clamps_max_tokens, decode_request, logprob_settings, note_truncated, reject_unimplemented, resolve_max_tokens, sampling_params, stop_regexes, stop_strings, truncate_prompt
from server.sse import done_event, sse_event, stream_api_error_event
from server.state import ServerState, sequence_constraint
from server.structured import apply_close_on_length, compile_constraint, constraint_spec_async

AnyRequest = TypeVar("AnyRequest", ChatCompletionRequest, CompletionRequest)


@dataclass(kw_only=True)
class Job:
    """A validated request, ready to run (an endpoint's job adds what its responses need)."""

    req: ChatCompletionRequest | CompletionRequest
    request_id: str
    specs: list[GenerationRequest]  # one per choice, in choice order
    truncated: int = 0  # prompt tokens removed by truncate_prompt_tokens, all prompts together
    scored_choices: list[str] | None = None  # choice texts whose probabilities are reported
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Sampling:
    """The request's sampling settings, checked once and shared by all its choices."""

    params: SamplingParams
    logprobs: bool  # token logprobs were asked for
    stop: tuple[str, ...]
    stop_regex: tuple[Any, ...]  # compiled ``regex`` patterns


# --------------------------------------------------------------------------- preparing


def decode(state: ServerState, body: bytes, cls: type[AnyRequest]) -> tuple[AnyRequest, dict[str, Any]]:
    """The body as ``cls`` and as sent (``extra_body`` merged); 404 unless ``model`` names the served
    model (``name`` or ``name@provider``) or one of its LoRA adapters (``adapter`` or ``name:adapter``)."""
    req, wire = decode_request(body, cls)
    adapter_in_model(state, req.model)
    return req, wire


def admit(state: ServerState, req: AnyRequest, *, reasoning_model: bool = False) -> AnyRequest:
    """``req`` without the fields this server does not implement (refused, or dropped where the
    request or route drops them), its engine-steering fields checked."""
    tiling = None if state.vision is None else ("tiles" if state.vision.family.tiles else "")
    req = reject_unimplemented(req, custom_logit_processor_enabled=state.settings.enable_custom_logit_processor,
                               reasoning_model=reasoning_model, image_tiling=tiling)
    return apply_engine_options(state, req)


def settle_sampling(state: ServerState, req: ChatCompletionRequest | CompletionRequest) -> Sampling:
    """The request's sampling parameters, logprob settings and stop conditions (a 400 names a bad one)."""
    chat = isinstance(req, ChatCompletionRequest)
    want_logprobs, top = logprob_settings(req.logprobs, req.top_logprobs if chat else None, chat=chat)
    params = sampling_params(req, vocab_size=state.vocab_size, eos_token_ids=state.eos_token_ids,
                             logprobs=want_logprobs, top_logprobs=top, tokenizer=state.tokenizer)
    return Sampling(params, want_logprobs, stop_strings(req.stop), stop_regexes(req.stop_regex))


def truncate_prompts(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                     prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """The prompts cut to ``truncate_prompt_tokens``, and the tokens removed from them all (noted
    for the response header and the log)."""
    cut = [truncate_prompt(prompt, req.truncate_prompt_tokens, state.settings.max_model_len) for prompt in prompts]
    removed = sum(count for _, count in cut)
    note_truncated(removed)
    return [kept for kept, _ in cut], removed


def max_tokens_for(state: ServerState, requested: int | None, prompt: list[int], param: str) -> int:
    """The completion budget of ``prompt``: ``requested`` (the request's ``param``) within the context,
    clamped where the route or ``--max-tokens-overflow`` says so, else a 400."""
    settings = state.settings
    return resolve_max_tokens(requested, len(prompt), settings.max_model_len, param,
                              clamp=clamps_max_tokens(settings.max_tokens_overflow))


async def constraint(state: ServerState, wire: dict[str, Any], tool_plan=None) -> tuple[Any, Any]:
    """The request's ``ConstraintSpec`` (structured outputs or forced tool calls) and the constraint
    compiled from it, or (None, None)."""
    spec = await constraint_spec_async(state, wire, tool_plan)
    return spec, await compile_constraint(state, spec)


def scored_choices(state: ServerState, spec, sampling: Sampling, prompts: list[list[int]]) -> list[list[int]] | None:
    """Token ids of the choices to score (choices with logprobs), or None."""
    scored = choice_token_ids(spec, sampling.logprobs, state.tokenizer, [len(p) for p in prompts],
                              state.settings.max_model_len)
    check_scoring_without_processor(scored, sampling.params)
    return scored


async def sequences(state: ServerState, request_id: str, req: ChatCompletionRequest | CompletionRequest,
                    wire: dict[str, Any], sampling: Sampling, compiled, budgets: list[tuple[list[int], int]],
                    **shared: Any) -> list[GenerationRequest]:
    """One engine request per choice: ``req.n`` for each (prompt, max_tokens) of ``budgets``, prompt-
    major (prompt p's choice j is p * n + j), each with its own seed and matcher; ``shared``: more
    fields all choices take (reasoning phase, prediction, scored choices). Their matchers are marked
    for ``close_on_length`` where the request or the server asks for it."""
    fields = {**_request_fields(state, req, sampling), **shared}
    specs = [_sequence(state, compiled, request_id=request_id, prompt_token_ids=prompt,
                       params=with_seed(sampling.params, j), max_tokens=max_tokens, **fields)
             for prompt, max_tokens in budgets for j in range(req.n)]
    await apply_close_on_length(state, wire, compiled, specs)
    return specs


def _sequence(state: ServerState, compiled, **fields: Any) -> GenerationRequest:
    matcher, token_dfa = sequence_constraint(state, compiled)
    return GenerationRequest(sink=unsubmitted, matcher=matcher, token_dfa=token_dfa, **fields)


def _request_fields(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                    sampling: Sampling) -> dict[str, Any]:
    """The engine fields every sequence of ``req`` shares: stops, special tokens, adapter, tier."""
    return {
        "stop": sampling.stop,
        "stop_token_ids": frozenset(req.stop_token_ids or ()),
        "eos_token_ids": state.eos_token_ids,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output or req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": bool(req.spaces_between_special_tokens),
        "stop_regex": sampling.stop_regex,
        "adapter": adapter_id(state, req),
        "return_hidden_states": bool(req.return_hidden_states),
        "speculation": req.speculation != "off",
        "service_tier": req.service_tier or "default",
    }


# --------------------------------------------------------------------------- responses


async def collect_choices(state: ServerState, job: Job) -> list[ChoiceResult]:
    """Run the job's sequences to the end: each choice's whole result (a failed generation is an
    APIError)."""
    return await collect(state.start_generation(job.request_id, job.specs), len(job.specs))


def response_fields(state: ServerState, job: Job) -> dict[str, Any]:
    """The fields of a whole (non-streamed) response besides its choices and usage."""
    return {"id": job.request_id, "created": job.created, "model": response_model(state, job.req),
            "system_fingerprint": state.system_fingerprint, "service_tier": response_tier(job.req)}


def choice_logprobs(texts: list[str] | None, values: list[float] | None) -> list[ChoiceLogprob] | None:
    """Each scored choice with its normalised log-probability."""
    if texts is None or values is None:
        return None
    return [ChoiceLogprob(choice=text, logprob=value) for text, value in zip(texts, values)]


class ChunkWriter(ABC):
    """An endpoint's chunks for one streamed job, in the SSE skeleton of :meth:`events`."""

    object_name = ""  # every chunk's ``object``

    def __init__(self, state: ServerState, job: Job) -> None:
        self.state = state
        self.job = job

    @classmethod
    async def events(cls, state: ServerState, job: Job, stream: GenerationStream) -> AsyncIterator[bytes]:
        """SSE events in OpenAI's format: the opening chunks and the chunks of every delta, an error
        event if generation fails, the usage chunk (``stream_options.include_usage``), then
        ``data: [DONE]``. The generation stream is closed however the events end."""
        options = job.req.stream_options
        try:
            writer = cls(state, job)
            for chunk in writer.opening():
                yield sse_event(chunk)
            async for index, delta in stream:
                if delta.finish_reason == "error":
                    yield stream_api_error_event(generation_error(delta.error or "generation failed"))
                    break
                for chunk in writer.chunks(index, delta):
                    yield sse_event(chunk)
            else:
                try:
                    await writer.finished()
                except APIError as exc:  # e.g. the store is down: the answer was not kept, so no [DONE]
                    yield stream_api_error_event(exc)
                    return
            if options and options.include_usage:
                yield sse_event({**writer.head(), "choices": [], "usage": msgspec.to_builtins(writer.usage())})
            yield done_event()
        finally:
            stream.close()

    def opening(self) -> Iterable[dict]:
        """The chunks sent before the first delta."""
        return ()

    @abstractmethod
    def chunks(self, index: int, delta: SequenceDelta) -> Iterable[dict]:
        """The chunks that one engine delta of choice ``index`` becomes."""

    @abstractmethod
    def usage(self) -> Usage:
        """The usage of what was streamed so far."""

    async def finished(self) -> None:
        """Every choice finished without an error (called before the usage chunk)."""

    def head(self) -> dict[str, Any]:
        """The fields every chunk starts with."""
        job = self.job
        head = {"id": job.request_id, "object": self.object_name, "created": job.created,
                "model": response_model(self.state, job.req), "system_fingerprint": self.state.system_fingerprint}
        if job.req.service_tier is not None:
            head["service_tier"] = response_tier(job.req)
        return head

    def chunk(self, index: int, body: dict[str, Any], logprobs, finish: str | None, *, stop_reason=None,
              matched_stop=None, usage: Usage | None = None, scored: list[ChoiceLogprob] | None = None,
              hidden_states=None) -> dict[str, Any]:
        """A chunk of choice ``index``: ``body`` is its ``delta`` or ``text``; the stop reason and the
        matched stop come with a finish reason."""
        choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
            choice["matched_stop"] = matched_stop
        if scored is not None:
            choice["choice_logprobs"] = msgspec.to_builtins(scored)
        if hidden_states:
            choice["hidden_states"] = hidden_states
        chunk = {**self.head(), "choices": [choice]}
        if usage is not None:
            chunk["usage"] = msgspec.to_builtins(usage)
        return chunk
