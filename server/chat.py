"""``POST /v1/chat/completions``: request → prompt + constraint → engine → response or SSE."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from server import tools as tool_calls
from server.errors import APIError, bad_request
from server.generation import ChoiceResult, GenerationStream, SequenceSpec, collect, new_request_id, with_seed
from server.dialect import split_model
from server.render import RenderJob
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    Usage,
)
from server.requests import (
    check_limits,
    decode_request,
    logprob_settings,
    reject_unimplemented,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from server.tools.output import ChoiceStreamer, ReasoningOutput, parse_choice, with_reasoning
from server.tools.select import markers_are_special, request_format
from server.sse import done_event, sse_event, stream_error_event
from server.state import ServerState, sequence_constraint
from server.structured import compile_constraint, constraint_spec_async


@dataclass
class ChatJob:
    """A validated chat request, ready to run."""

    req: ChatCompletionRequest
    request_id: str
    prompt_ids: list[int]
    specs: list[SequenceSpec]
    tool_plan: object | None
    echo_prefix: str = ""
    tool_format: object | None = None  # the model's tool-call format (server.tools.formats), when output is parsed
    prompt_tail: str = ""  # the end of the rendered prompt (an open reasoning segment, a sub-format)
    wire: dict = field(default_factory=dict)  # the request as sent (extra_body merged), for the store
    created: int = field(default_factory=lambda: int(time.time()))


async def prepare_chat(state: ServerState, body: bytes) -> ChatJob:
    req, wire = decode_request(body, ChatCompletionRequest)
    check_model(state, req.model)
    if req.conversation is not None:
        req = await _with_conversation(state, req)
    req = reject_unimplemented(req)
    check_limits(req)
    plan = tool_calls.plan_tools(req)
    fmt, recognised = request_format(state, req.chat_template)
    if plan is not None:
        plan = dataclasses.replace(plan, format_name=fmt.name)
    want_logprobs, top = logprob_settings(req.logprobs, req.top_logprobs, chat=True)
    params = sampling_params(
        req, vocab_size=state.vocab_size, eos_token_ids=state.eos_token_ids, logprobs=want_logprobs, top_logprobs=top
    )
    stop_strings(req.stop)
    prompt_ids = await render_prompt(state, req, plan)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), state.settings.max_model_len, param)
    spec = await constraint_spec_async(state, wire, plan)
    compiled = await compile_constraint(state, spec)
    specs = [
        SequenceSpec(prompt_ids, with_seed(params, i), max_tokens, *sequence_constraint(state, compiled))
        for i in range(req.n)
    ]
    echo = _echo_prefix(req)
    parse = plan is not None or (recognised and fmt.has_reasoning)
    tail = state.tokenizer.decode(prompt_ids[-32:]) if parse else ""
    if parse and "skip_special_tokens" not in wire and markers_are_special(state, fmt):
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the parser needs the markers
    return ChatJob(req, new_request_id("chatcmpl"), prompt_ids, specs, plan, echo, wire=wire,
                   tool_format=fmt if parse else None, prompt_tail=tail)


async def _with_conversation(state: ServerState, req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The stored conversation's messages before the request's own (404/403 as APIError)."""
    from server.auth import current_principal
    from server.store.flow import conversation_messages

    store = _store(state)
    principal = current_principal()
    history = await conversation_messages(store, principal.user if principal else "anonymous", req.conversation)
    try:
        earlier = msgspec.convert(history, list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise bad_request(f"the stored conversation cannot be replayed: {exc}", param="conversation") from None
    return msgspec.structs.replace(req, messages=earlier + list(req.messages))


def _store(state: ServerState):
    store = state.store
    if store is None:
        raise APIError("stored conversations are not enabled on this server", status=503, code="store_unavailable")
    return store


async def persist_chat(state: ServerState, job: ChatJob, result: ChatCompletion) -> None:
    """``store: true`` keeps the completion; with a ``conversation`` it also appends this turn."""
    req = job.req
    if not req.store:
        return
    from server.auth import current_principal
    from server.store.flow import conversation_id_of, record

    principal = current_principal()
    wire = dict(job.wire)
    if req.conversation is not None:  # keep what the client sent, not the replayed history
        wire["messages"] = wire.get("messages") or []
    await record(
        _store(state),
        principal.user if principal else "anonymous",
        wire,
        msgspec.to_builtins(result),
        store_completion=True,
        conversation_id=conversation_id_of(req.conversation),
        store_reasoning=bool(req.store_reasoning),
    )


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless ``model`` names the served model (``name`` or ``name@provider``)."""
    model, _ = split_model(model, state.provider_aliases)
    if model is not None and model != state.model_name:
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


async def render_prompt(state: ServerState, req: ChatCompletionRequest, plan) -> list[int]:
    """Apply the chat template (request overrides first) and tokenize, off the event loop."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message", param="messages")
    supports_tools = tool_calls.template_supports_tools(state.tokenizer, req.chat_template)
    messages, tools = tool_calls.render_messages(req.messages, plan, supports_tools)
    kwargs = dict(req.chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    job = RenderJob(
        messages=messages,
        chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        kwargs=kwargs,
    )
    return await state.renderer.render(job)


def _echo_prefix(req: ChatCompletionRequest) -> str:
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    if last.role != "assistant" or not isinstance(last.content, str):
        return ""
    return last.content


# --------------------------------------------------------------------------- running


async def run_chat(state: ServerState, job: ChatJob) -> ChatCompletion:
    """Generate all choices and build the non-streamed response."""
    stream = state.start_generation(job.request_id, job.specs, job.req)
    return _completion(state, job, await collect(stream, len(job.specs)))


def _completion(state: ServerState, job: ChatJob, choices: list[ChoiceResult]) -> ChatCompletion:
    return ChatCompletion(
        id=job.request_id,
        created=job.created,
        model=state.model_name,
        system_fingerprint=state.system_fingerprint,
        choices=[_chat_choice(state, job, i, c) for i, c in enumerate(choices)],
        usage=_usage(job, sum(c.completion_tokens for c in choices)),
    )


def _chat_choice(state: ServerState, job: ChatJob, index: int, choice: ChoiceResult) -> ChatChoice:
    text = job.echo_prefix + "".join(choice.text)
    finish = choice.finish_reason
    message = AssistantMessage(content=text)
    if job.tool_format is not None:
        content, reasoning, calls = parse_choice(
            job.tool_format, job.tool_plan, text, job.prompt_tail, ReasoningOutput.of(job.req)
        )
        message = with_reasoning(tool_calls.assistant_message(content, calls, job.tool_plan), reasoning)
        finish = tool_calls.finish_reason(job.tool_plan, bool(calls), finish)
    logprobs = None
    if job.req.logprobs:
        logprobs = ChoiceLogprobs(content=state.token_texts.chat_entries(choice.logprobs))
    return ChatChoice(
        index=index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=choice.stop_reason
    )


def _usage(job: ChatJob, completion_tokens: int) -> Usage:
    prompt = len(job.prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


# --------------------------------------------------------------------------- streaming


async def stream_chat(state: ServerState, job: ChatJob, stream: GenerationStream) -> AsyncIterator[bytes]:
    """SSE chunks in OpenAI's format, ending with ``data: [DONE]``."""
    options = job.req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    streamers = [
        ChoiceStreamer(job.tool_format, job.tool_plan, job.prompt_tail, ReasoningOutput.of(job.req)) if job.tool_format is not None else None
        for _ in job.specs
    ]
    completion_tokens = [0] * len(job.specs)
    results = [ChoiceResult() for _ in job.specs]  # the whole answer, for a stored completion
    failed = False
    try:
        for index in range(len(job.specs)):
            first = {"role": "assistant", "content": job.echo_prefix}
            yield sse_event(_chunk(state, job, index, first, None, None))
        async for index, delta in stream:
            if delta.finish_reason == "error":
                yield stream_error_event(delta.error or "generation failed")
                failed = True
                break
            results[index].add(delta)
            completion_tokens[index] = delta.completion_tokens
            usage = _usage(job, sum(completion_tokens)) if continuous else None
            for chunk in _delta_chunks(state, job, index, delta, streamers[index], usage):
                yield sse_event(chunk)
        if not failed:
            await persist_chat(state, job, _completion(state, job, results))  # before the last chunks
        if include_usage:
            usage_chunk = _base_chunk(state, job)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = msgspec.to_builtins(_usage(job, sum(completion_tokens)))
            yield sse_event(usage_chunk)
        yield done_event()
    finally:
        stream.close()


def _delta_chunks(state, job, index, delta, streamer, usage):
    logprobs = None
    if job.req.logprobs and delta.logprobs:
        logprobs = {"content": msgspec.to_builtins(state.token_texts.chat_entries(delta.logprobs))}
    pieces = [{"content": delta.text}] if delta.text else []
    finish = delta.finish_reason
    if streamer is not None:
        pieces = streamer.feed(delta.text) if delta.text else []
        if finish:
            pieces += streamer.finish()
            finish = tool_calls.finish_reason(job.tool_plan, streamer.has_calls, finish)
    if not pieces and (logprobs or finish):
        pieces = [{}]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield _chunk(state, job, index, piece, logprobs if i == 0 else None, finish if last else None,
                     stop_reason=delta.stop_reason if last and finish else None, usage=usage)


def _base_chunk(state: ServerState, job: ChatJob) -> dict:
    return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created, "model": state.model_name,
            "system_fingerprint": state.system_fingerprint}


def _chunk(state, job, index, delta, logprobs, finish, *, stop_reason=None, usage=None) -> dict:
    chunk = _base_chunk(state, job)
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = msgspec.to_builtins(usage)
    return chunk
