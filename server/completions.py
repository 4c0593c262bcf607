"""``POST /v1/completions``: raw prompts (text or token ids), one choice per prompt × n, through the
request pipeline (:mod:`server.pipeline`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from server.engine.sequence import SequenceDelta
from server.errors import bad_request
from server.generation import ChoiceResult, new_request_id
from server.pipeline import ChunkWriter, Job, admit, choice_logprobs, collect_choices, constraint, decode, max_tokens_for, response_fields, scored_choices, sequences, settle_sampling, truncate_prompts
from server.protocol import Completion, CompletionChoice, CompletionRequest, Usage
from server.requests import build_usage, check_limits
from server.state import ServerState


@dataclass(kw_only=True)
class CompletionJob(Job):
    """A validated completion request, ready to run; ``specs`` are prompt-major (choice index =
    prompt * n + j)."""

    prompts: list[list[int]]
    echo_texts: list[str]


async def prepare_completion(state: ServerState, body: bytes) -> CompletionJob:
    """Validate a completion request, tokenize its prompts and compile its constraint: the job to run."""
    req, wire = decode(state, body, CompletionRequest)
    req = admit(state, req)
    sampling = settle_sampling(state, req)
    check_limits(req, _prompt_count(req.prompt))
    prompts, truncated = truncate_prompts(state, req, await asyncio.to_thread(_prompts, state, req))
    spec, compiled = await constraint(state, wire)
    scored = scored_choices(state, spec, sampling, prompts)
    requested = req.max_tokens if req.max_tokens is not None else 16
    budgets = [(prompt, max_tokens_for(state, requested, prompt, "max_tokens")) for prompt in prompts]
    request_id = new_request_id("cmpl")
    specs = await sequences(state, request_id, req, wire, sampling, compiled, budgets, score_choices=scored)
    echo = [state.tokenizer.decode(p) if req.echo else "" for p in prompts]
    return CompletionJob(req=req, request_id=request_id, prompts=prompts, specs=specs, echo_texts=echo,
                         truncated=truncated, scored_choices=list(spec.source) if scored else None)


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


def _usage(job: CompletionJob, completion_tokens: int, cached: list[int] | None = None) -> Usage:
    """``cached``: each sequence's prompt tokens from the prefix cache (a prompt counts once:
    its first choice's)."""
    return build_usage(sum(len(p) for p in job.prompts), completion_tokens,
                       cached_details=job.req.return_cached_tokens_details, truncated=job.truncated,
                       cached=sum((cached or [])[:: job.req.n]))


async def run_completion(state: ServerState, job: CompletionJob) -> Completion:
    """Generate all choices and build the non-streamed response."""
    results = await collect_choices(state, job)
    choices = [_choice(state, job, i, result) for i, result in enumerate(results)]
    usage = _usage(job, sum(r.completion_tokens for r in results), [r.cached_tokens for r in results])
    return Completion(**response_fields(state, job), choices=choices, usage=usage)


def _choice(state: ServerState, job: CompletionJob, index: int, result: ChoiceResult) -> CompletionChoice:
    echo = job.echo_texts[index // job.req.n]
    lp = state.token_texts.completion_logprobs(result.logprobs, len(echo)) if job.req.logprobs is not None else None
    hidden = result.hidden_states if job.req.return_hidden_states else msgspec.UNSET
    return CompletionChoice(index=index, text=echo + "".join(result.text), logprobs=lp,
                            finish_reason=result.finish_reason, stop_reason=result.stop_reason,
                            matched_stop=result.matched_stop,
                            choice_logprobs=choice_logprobs(job.scored_choices, result.choice_logprobs),
                            hidden_states=hidden)


class _CompletionChunks(ChunkWriter):
    """A text completion's chunks: each delta's text (after the echoed prompt) with its logprobs."""

    object_name = "text_completion"
    job: CompletionJob

    def __init__(self, state: ServerState, job: CompletionJob) -> None:
        super().__init__(state, job)
        self.tokens = [0] * len(job.specs)
        self.cached = [0] * len(job.specs)
        self.offsets = [len(self._echo(i)) for i in range(len(job.specs))]  # of each choice's text so far

    def _echo(self, index: int) -> str:
        return self.job.echo_texts[index // self.job.req.n]

    def opening(self) -> Iterator[dict]:
        for index in range(len(self.job.specs)):
            if self._echo(index):
                yield self.chunk(index, {"text": self._echo(index)}, None, None)

    def chunks(self, index: int, delta: SequenceDelta) -> Iterator[dict]:
        self.tokens[index] = delta.completion_tokens
        self.cached[index] = delta.cached_tokens
        lp = None
        if self.job.req.logprobs is not None and delta.logprobs:
            lp = msgspec.to_builtins(self.state.token_texts.completion_logprobs(delta.logprobs, self.offsets[index]))
        self.offsets[index] += len(delta.text)
        scored = choice_logprobs(self.job.scored_choices, delta.choice_logprobs) if delta.finish_reason else None
        yield self.chunk(index, {"text": delta.text}, lp, delta.finish_reason, stop_reason=delta.stop_reason,
                         matched_stop=delta.matched_stop, scored=scored, hidden_states=delta.hidden_states)

    def usage(self) -> Usage:
        return _usage(self.job, sum(self.tokens), self.cached)


stream_completion = _CompletionChunks.events  # SSE chunks in OpenAI's format, ending with ``data: [DONE]``
