"""``POST /v1/completions``: raw prompts (text or token ids), one choice per prompt × n."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from server.chat import check_model, choice_logprobs
from server.engine_options import apply_engine_options, response_model, response_tier
from server.errors import bad_request
from server.generation import GenerationStream, SequenceSpec, collect, generation_error, new_request_id, with_seed
from server.protocol import Completion, CompletionChoice, CompletionRequest, Usage
from server.requests import (
    build_usage,
    check_limits,
    clamps_max_tokens,
    note_truncated,
    stop_regexes,
    truncate_prompt,
    check_scoring_without_processor,
    choice_token_ids,
    decode_request,
    logprob_settings,
    reject_unimplemented,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from server.sse import done_event, sse_event, stream_api_error_event
from server.state import ServerState, sequence_constraint
from server.structured import apply_close_on_length, compile_constraint, constraint_spec_async


@dataclass
class CompletionJob:
    req: CompletionRequest
    request_id: str
    prompts: list[list[int]]
    specs: list[SequenceSpec]  # prompt-major: choice index = prompt * n + j
    echo_texts: list[str]
    truncated: int = 0  # prompt tokens removed by truncate_prompt_tokens, all prompts together
    created: int = field(default_factory=lambda: int(time.time()))
    scored_choices: list[str] | None = None  # choice texts whose probabilities are reported


def _prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """Text or token-id prompts, one or many, as token-id lists."""
    prompt = req.prompt
    items = [prompt] if isinstance(prompt, str) else prompt
    if not items:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if all(isinstance(p, int) for p in items):
        items = [items]
    return [_prompt_ids(state, req, i, item) for i, item in enumerate(items)]


def _prompt_count(prompt) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def _prompt_ids(state: ServerState, req: CompletionRequest, i: int, item) -> list[int]:
    if isinstance(item, str):
        ids = list(state.tokenizer(item, add_special_tokens=req.add_special_tokens).input_ids)
    elif isinstance(item, list) and all(isinstance(t, int) and 0 <= t < state.vocab_size for t in item):
        ids = list(item)
    else:
        raise bad_request(f"prompt[{i}] must be a string or a list of token ids", param="prompt")
    if not ids:
        raise bad_request(f"prompt[{i}] is empty", param="prompt")
    return ids


async def prepare_completion(state: ServerState, body: bytes) -> CompletionJob:
    req, wire = decode_request(body, CompletionRequest)
    check_model(state, req.model)
    req = reject_unimplemented(req, custom_logit_processor_enabled=state.settings.enable_custom_logit_processor)
    req = apply_engine_options(state, req)
    want_logprobs, top = logprob_settings(req.logprobs, None, chat=False)
    params = sampling_params(
        req, vocab_size=state.vocab_size, eos_token_ids=state.eos_token_ids, logprobs=want_logprobs,
        top_logprobs=top, tokenizer=state.tokenizer,
    )
    stop_strings(req.stop)
    stop_regexes(req.stop_regex)
    check_limits(req, _prompt_count(req.prompt))
    settings = state.settings
    prompts, truncated = [], 0
    for prompt in await asyncio.to_thread(_prompts, state, req):
        kept, removed = truncate_prompt(prompt, req.truncate_prompt_tokens, settings.max_model_len)
        prompts.append(kept)
        truncated += removed
    note_truncated(truncated)
    spec = await constraint_spec_async(state, wire, None)
    compiled = await compile_constraint(state, spec)
    scored = choice_token_ids(spec, want_logprobs, state.tokenizer, [len(p) for p in prompts], settings.max_model_len)
    check_scoring_without_processor(scored, params)
    clamp = clamps_max_tokens(settings.max_tokens_overflow)
    specs = []
    for prompt in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens if req.max_tokens is not None else 16, len(prompt),
                                        settings.max_model_len, "max_tokens", clamp=clamp)
        for j in range(req.n):
            specs.append(SequenceSpec(prompt, with_seed(params, j), max_tokens, *sequence_constraint(state, compiled),
                                      score_choices=scored))
    await apply_close_on_length(state, wire, compiled, specs)
    echo = [state.tokenizer.decode(p) if req.echo else "" for p in prompts]
    return CompletionJob(req, new_request_id("cmpl"), prompts, specs, echo, truncated,
                         scored_choices=list(spec.source) if scored else None)


def _usage(job: CompletionJob, completion_tokens: int, cached: list[int] | None = None) -> Usage:
    """``cached``: each sequence's prompt tokens from the prefix cache (a prompt counts once:
    its first choice's)."""
    return build_usage(sum(len(p) for p in job.prompts), completion_tokens,
                       cached_details=job.req.return_cached_tokens_details, truncated=job.truncated,
                       cached=sum((cached or [])[:: job.req.n]))


async def run_completion(state: ServerState, job: CompletionJob) -> Completion:
    stream = state.start_generation(job.request_id, job.specs, job.req)
    results = await collect(stream, len(job.specs))
    choices = []
    for i, result in enumerate(results):
        echo = job.echo_texts[i // job.req.n]
        lp = state.token_texts.completion_logprobs(result.logprobs, len(echo)) if job.req.logprobs is not None else None
        hidden = result.hidden_states if job.req.return_hidden_states else msgspec.UNSET
        choices.append(CompletionChoice(index=i, text=echo + "".join(result.text), logprobs=lp,
                                        finish_reason=result.finish_reason, stop_reason=result.stop_reason,
                                        matched_stop=result.matched_stop,
                                        choice_logprobs=choice_logprobs(job.scored_choices, result.choice_logprobs),
                                        hidden_states=hidden))
    return Completion(id=job.request_id, created=job.created, model=response_model(state, job.req), choices=choices,
                      system_fingerprint=state.system_fingerprint, service_tier=response_tier(job.req),
                      usage=_usage(job, sum(r.completion_tokens for r in results), [r.cached_tokens for r in results]))


async def stream_completion(state: ServerState, job: CompletionJob, stream: GenerationStream) -> AsyncIterator[bytes]:
    options = job.req.stream_options
    include_usage = bool(options and options.include_usage)
    tokens = [0] * len(job.specs)
    cached = [0] * len(job.specs)
    offsets = [len(job.echo_texts[i // job.req.n]) for i in range(len(job.specs))]
    try:
        for i in range(len(job.specs)):
            echo = job.echo_texts[i // job.req.n]
            if echo:
                yield sse_event(_chunk(state, job, i, echo, None, None))
        async for index, delta in stream:
            if delta.finish_reason == "error":
                yield stream_api_error_event(generation_error(delta.error or "generation failed"))
                break
            tokens[index] = delta.completion_tokens
            cached[index] = delta.cached_tokens
            lp = None
            if job.req.logprobs is not None and delta.logprobs:
                lp = msgspec.to_builtins(state.token_texts.completion_logprobs(delta.logprobs, offsets[index]))
            offsets[index] += len(delta.text)
            chunk = _chunk(state, job, index, delta.text, lp, delta.finish_reason, delta.stop_reason,
                           delta.matched_stop)
            scored = choice_logprobs(job.scored_choices, delta.choice_logprobs) if delta.finish_reason else None
            if scored is not None:
                chunk["choices"][0]["choice_logprobs"] = msgspec.to_builtins(scored)
            if delta.hidden_states:
                chunk["choices"][0]["hidden_states"] = delta.hidden_states
            yield sse_event(chunk)
        if include_usage:
            chunk = {**_chunk_head(state, job), "choices": [], "usage": msgspec.to_builtins(_usage(job, sum(tokens), cached))}
            yield sse_event(chunk)
        yield done_event()
    finally:
        stream.close()


def _chunk(state, job, index, text, logprobs, finish, stop_reason=None, matched_stop=None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
        choice["matched_stop"] = matched_stop
    return {**_chunk_head(state, job), "choices": [choice]}


def _chunk_head(state: ServerState, job: CompletionJob) -> dict:
    head = {"id": job.request_id, "object": "text_completion", "created": job.created,
            "model": response_model(state, job.req), "system_fingerprint": state.system_fingerprint}
    if job.req.service_tier is not None:
        head["service_tier"] = response_tier(job.req)
    return head
