"""``POST /v1/chat/completions``: request → prompt + constraint → engine → response or SSE."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from server import reasoning as reasoning_mod
from server import tools as tool_calls
from server.errors import APIError, bad_request
from server.generation import (ChoiceResult, GenerationStream, SequenceSpec, collect, generation_error,
                               new_request_id, with_seed)
from server.render import RenderJob, template_source, with_documents_and_verbosity
from server.engine_options import adapter_in_model, apply_engine_options, response_model, response_tier
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprob,
    ChoiceLogprobs,
    CompletionTokensDetails,
    Usage,
)
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
    prediction_text,
    reject_unimplemented,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from server.tools.output import ChoiceStreamer, ReasoningOutput, parse_choice, with_reasoning
from server.tools.select import markers_are_special, request_format
from server.sse import done_event, sse_event, stream_api_error_event
from server.state import ServerState, sequence_constraint
from server.structured import apply_close_on_length, compile_constraint, constraint_spec_async


@dataclass
class ChatJob:
    """A validated chat request, ready to run."""

    req: ChatCompletionRequest
    request_id: str
    prompt_ids: list[int]
    specs: list[SequenceSpec]
    tool_plan: object | None
    echo_prefix: str = ""
    reasoning: reasoning_mod.ReasoningSetup | None = None  # the model thinks before it answers
    truncated: int = 0  # prompt tokens removed by truncate_prompt_tokens
    tool_format: object | None = None  # the model's tool-call format (server.tools.formats), when output is parsed
    prompt_tail: str = ""  # the end of the rendered prompt (an open reasoning segment, a sub-format)
    wire: dict = field(default_factory=dict)  # the request as sent (extra_body merged), for the store
    scored_choices: list[str] | None = None  # choice texts whose probabilities are reported
    created: int = field(default_factory=lambda: int(time.time()))


async def prepare_chat(state: ServerState, body: bytes) -> ChatJob:
    req, wire = decode_request(body, ChatCompletionRequest)
    check_model(state, req.model)
    if req.conversation is not None:
        req = await _with_conversation(state, req)
    reasoning_format = reasoning_mod.detect_reasoning(state.tokenizer, req.chat_template)
    req = reject_unimplemented(req, custom_logit_processor_enabled=state.settings.enable_custom_logit_processor,
                               reasoning_model=reasoning_format is not None)
    req = apply_engine_options(state, req)
    check_limits(req)
    req = reasoning_mod.apply_deep_research(req, reasoning_format)
    switches = reasoning_mod.read_switches(req)
    plan = tool_calls.plan_tools(req)
    fmt, recognised = request_format(state, req.chat_template)
    if plan is not None:
        plan = dataclasses.replace(plan, format_name=fmt.name)
    want_logprobs, top = logprob_settings(req.logprobs, req.top_logprobs, chat=True)
    params = sampling_params(
        req, vocab_size=state.vocab_size, eos_token_ids=state.eos_token_ids, logprobs=want_logprobs,
        top_logprobs=top, tokenizer=state.tokenizer,
    )
    stop_strings(req.stop)
    stop_regexes(req.stop_regex)
    settings = state.settings
    prompt_ids, truncated = truncate_prompt(await render_prompt(state, req, plan, reasoning_format, switches),
                                            req.truncate_prompt_tokens, settings.max_model_len)
    note_truncated(truncated)
    reasoning = reasoning_mod.setup_reasoning(reasoning_format, switches, state.tokenizer, prompt_ids)
    if reasoning is not None and reasoning_mod.keeps_special_tokens(reasoning.format, state.tokenizer):
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the markers are split off below
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), settings.max_model_len, param,
                                    clamp=clamps_max_tokens(settings.max_tokens_overflow))
    spec = await constraint_spec_async(state, wire, plan)
    compiled = await compile_constraint(state, spec)
    tool_call = plan is not None and plan.mode != "none" and fmt.name == "gpt-oss"
    phase = reasoning_mod.engine_phase(reasoning, state.tokenizer, constrained=compiled is not None,
                                       harmony_tool_call=tool_call)
    predicted = prediction_text(req.prediction)
    prediction_ids = list(state.tokenizer.encode(predicted, add_special_tokens=False)) if predicted else None
    scored = None  # a reasoning model thinks first: its choice does not follow the prompt directly
    if phase is None:
        scored = choice_token_ids(spec, want_logprobs, state.tokenizer, [len(prompt_ids)], settings.max_model_len)
        check_scoring_without_processor(scored, params)
    specs = [
        SequenceSpec(prompt_ids, with_seed(params, i), max_tokens, *sequence_constraint(state, compiled), phase,
                     prediction_token_ids=prediction_ids, score_choices=scored)
        for i in range(req.n)
    ]
    await apply_close_on_length(state, wire, compiled, specs)
    echo = _echo_prefix(req)
    parse = plan is not None or (recognised and fmt.has_reasoning)
    tail = state.tokenizer.decode(prompt_ids[-32:]) if parse else ""
    if parse and "skip_special_tokens" not in wire and markers_are_special(state, fmt):
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the parser needs the markers
    return ChatJob(req, new_request_id("chatcmpl"), prompt_ids, specs, plan, echo, reasoning=reasoning,
                   truncated=truncated, tool_format=fmt if parse else None, prompt_tail=tail, wire=wire,
                   scored_choices=list(spec.source) if scored else None)


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
    """404 unless ``model`` names the served model (``name`` or ``name@provider``) or one of its
    LoRA adapters (``adapter`` or ``name:adapter``)."""
    adapter_in_model(state, model)


async def render_prompt(state: ServerState, req: ChatCompletionRequest, plan, reasoning_format=None,
                        switches=None) -> list[int]:
    """Apply the chat template (request overrides first) and tokenize, off the event loop."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message", param="messages")
    supports_tools = tool_calls.template_supports_tools(state.tokenizer, req.chat_template)
    messages, tools = tool_calls.render_messages(req.messages, plan, supports_tools)
    kwargs = dict(req.chat_template_kwargs or {})
    if switches is not None:
        kwargs = reasoning_mod.template_kwargs(reasoning_format, switches, kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    source = template_source(state.tokenizer, req.chat_template)
    messages = with_documents_and_verbosity(messages, kwargs, source, req.documents, req.verbosity)
    job = RenderJob(
        messages=messages,
        chat_template=req.chat_template,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        kwargs=kwargs,
        add_special_tokens=req.add_special_tokens,
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
        model=response_model(state, job.req),
        system_fingerprint=state.system_fingerprint,
        choices=[_chat_choice(state, job, i, c) for i, c in enumerate(choices)],
        usage=_usage(job, choices),
        service_tier=response_tier(job.req),
    )


def _chat_choice(state: ServerState, job: ChatJob, index: int, choice: ChoiceResult) -> ChatChoice:
    reasoning, text = _split_reasoning(job, "".join(choice.text))
    text = job.echo_prefix + text
    finish = choice.finish_reason
    message = AssistantMessage(content=text)
    if job.tool_format is not None:
        content, reasoning, calls = parse_choice(
            job.tool_format, job.tool_plan, text, job.prompt_tail, ReasoningOutput.of(job.req)
        )
        message = with_reasoning(tool_calls.assistant_message(content, calls, job.tool_plan), reasoning)
        finish = tool_calls.finish_reason(job.tool_plan, bool(calls), finish)
    if reasoning is not None:
        message = msgspec.structs.replace(message, reasoning_content=reasoning)
    logprobs = None
    if job.req.logprobs:
        logprobs = ChoiceLogprobs(content=state.token_texts.chat_entries(choice.logprobs))
    return ChatChoice(
        index=index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=choice.stop_reason,
        matched_stop=choice.matched_stop,
        choice_logprobs=choice_logprobs(job.scored_choices, choice.choice_logprobs),
        hidden_states=choice.hidden_states if job.req.return_hidden_states else msgspec.UNSET,
    )


def choice_logprobs(texts: list[str] | None, values: list[float] | None) -> list[ChoiceLogprob] | None:
    """Each scored choice with its normalised log-probability."""
    if texts is None or values is None:
        return None
    return [ChoiceLogprob(choice=text, logprob=value) for text, value in zip(texts, values)]


# The plain <think>/harmony split (server/reasoning.py), for reasoning models whose output is not
# parsed by a tool-call format's parser (which splits reasoning itself).


def _split_reasoning(job: ChatJob, text: str) -> tuple[str | None, str]:
    """(reasoning_content or None, the answer text) of one whole output."""
    if job.reasoning is None or job.tool_format is not None:
        return None, text
    reasoning, content = reasoning_mod.split_reasoning(text, job.reasoning.format, job.reasoning.starts_inside)
    return reasoning or None, content


def _reasoning_streamer(job: ChatJob) -> reasoning_mod.ReasoningStreamSplitter | None:
    if job.reasoning is None or job.tool_format is not None:
        return None
    return reasoning_mod.ReasoningStreamSplitter(job.reasoning.format, job.reasoning.starts_inside)


def _usage(job: ChatJob, choices: list[ChoiceResult]) -> Usage:
    completion_tokens = sum(c.completion_tokens for c in choices)
    details = None
    drafted = sum(c.accepted_draft_tokens + c.rejected_draft_tokens for c in choices)
    if job.req.prediction is not None or drafted:
        details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in choices),
            rejected_prediction_tokens=sum(c.rejected_prediction_tokens for c in choices),
        )
    if drafted:
        details.accepted_draft_tokens = sum(c.accepted_draft_tokens for c in choices)
        details.rejected_draft_tokens = sum(c.rejected_draft_tokens for c in choices)
    return build_usage(len(job.prompt_ids), completion_tokens, cached_details=job.req.return_cached_tokens_details,
                       truncated=job.truncated, completion_details=details,
                       cached=choices[0].cached_tokens if choices else 0)


# --------------------------------------------------------------------------- streaming


async def stream_chat(state: ServerState, job: ChatJob, stream: GenerationStream) -> AsyncIterator[bytes]:
    """SSE chunks in OpenAI's format, ending with ``data: [DONE]``."""
    options = job.req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    streamers = [
        ChoiceStreamer(job.tool_format, job.tool_plan, job.prompt_tail, ReasoningOutput.of(job.req))
        if job.tool_format is not None else None
        for _ in job.specs
    ]
    splitters = [_reasoning_streamer(job) for _ in job.specs]
    results = [ChoiceResult() for _ in job.specs]  # the whole answer, for a stored completion
    failed = False
    try:
        for index in range(len(job.specs)):
            first = {"role": "assistant", "content": job.echo_prefix}
            yield sse_event(_chunk(state, job, index, first, None, None))
        async for index, delta in stream:
            if delta.finish_reason == "error":
                yield stream_api_error_event(generation_error(delta.error or "generation failed"))
                failed = True
                break
            results[index].add(delta)
            usage = _usage(job, results) if continuous else None
            for chunk in _delta_chunks(state, job, index, delta, streamers[index], usage, splitters[index]):
                yield sse_event(chunk)
        if not failed:
            await persist_chat(state, job, _completion(state, job, results))  # before the last chunks
        if include_usage:
            usage_chunk = _base_chunk(state, job)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = msgspec.to_builtins(_usage(job, results))
            yield sse_event(usage_chunk)
        yield done_event()
    finally:
        stream.close()


def _delta_chunks(state, job, index, delta, streamer, usage, splitter=None):
    logprobs = None
    if job.req.logprobs and delta.logprobs:
        logprobs = {"content": msgspec.to_builtins(state.token_texts.chat_entries(delta.logprobs))}
    finish = delta.finish_reason
    text, thought = delta.text, ""
    if splitter is not None:
        thought, text = splitter.feed(delta.text, final=bool(finish))
    pieces = [{"content": text}] if text else []
    if streamer is not None:
        pieces = streamer.feed(text) if text else []
        if finish:
            pieces += streamer.finish()
            finish = tool_calls.finish_reason(job.tool_plan, streamer.has_calls, finish)
    if thought:
        pieces.insert(0, {"reasoning_content": thought})
    if not pieces and (logprobs or finish):
        pieces = [{}]
    if delta.hidden_states and not pieces:
        pieces = [{}]
    scored = choice_logprobs(job.scored_choices, delta.choice_logprobs) if finish else None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk = _chunk(state, job, index, piece, logprobs if i == 0 else None, finish if last else None,
                       stop_reason=delta.stop_reason if last and finish else None,
                       matched_stop=delta.matched_stop if last and finish else None, usage=usage)
        if last and scored is not None:
            chunk["choices"][0]["choice_logprobs"] = msgspec.to_builtins(scored)
        if i == 0 and delta.hidden_states:
            chunk["choices"][0]["hidden_states"] = delta.hidden_states
        yield chunk


def _base_chunk(state: ServerState, job: ChatJob) -> dict:
    chunk = {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
             "model": response_model(state, job.req), "system_fingerprint": state.system_fingerprint}
    if job.req.service_tier is not None:
        chunk["service_tier"] = response_tier(job.req)
    return chunk


def _chunk(state, job, index, delta, logprobs, finish, *, stop_reason=None, matched_stop=None, usage=None) -> dict:
    chunk = _base_chunk(state, job)
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
        choice["matched_stop"] = matched_stop
    chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = msgspec.to_builtins(usage)
    return chunk
