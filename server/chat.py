"""``POST /v1/chat/completions``: messages (with tools and reasoning) → rendered prompt → the request
pipeline (:mod:`server.pipeline`) → a chat completion or its SSE chunks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from server import reasoning as reasoning_mod
from server import tools as tool_calls
from server.engine.sequence import ReasoningPhase, SequenceDelta
from server.errors import APIError, bad_request
from server.generation import ChoiceResult, new_request_id
from server.pipeline import ChunkWriter, Job, admit, choice_logprobs, collect_choices, constraint, decode, max_tokens_for, response_fields, scored_choices, sequences, settle_sampling, truncate_prompts
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    CompletionTokensDetails,
    Usage,
)
from server.render import RenderJob, template_source, with_documents_and_verbosity
from server.requests import build_usage, check_limits, prediction_text
from server.state import ServerState
from server.tools.formats import ToolFormat
from server.tools.output import ChoiceStreamer, ReasoningOutput, parse_choice, with_reasoning
from server.tools.plan import ToolPlan
from server.tools.select import markers_are_special, request_format


@dataclass(kw_only=True)
class ChatJob(Job):
    """A validated chat request, ready to run."""

    prompt_ids: list[int]
    tool_plan: object | None = None
    echo_prefix: str = ""
    reasoning: reasoning_mod.ReasoningSetup | None = None  # the model thinks before it answers
    tool_format: object | None = None  # the model's tool-call format (server.tools.formats), when output is parsed
    prompt_tail: str = ""  # the end of the rendered prompt (an open reasoning segment, a sub-format)
    wire: dict = field(default_factory=dict)  # the request as sent (extra_body merged), for the store


async def prepare_chat(state: ServerState, body: bytes) -> ChatJob:
    """Validate a chat request, render its prompt and compile its constraint: the job to run."""
    req, wire, reasoning_format, switches = await _checked_request(state, body)
    plan, fmt, recognised = _tool_plan(state, req)
    sampling = settle_sampling(state, req)
    pictures = await load_pictures(state, req)
    rendered = await render_prompt(state, req, plan, reasoning_format, switches, with_images=bool(pictures))
    [prompt_ids], truncated = truncate_prompts(state, req, [rendered])
    media = None
    if pictures:
        prompt_ids, media = await state.vision.expand(prompt_ids, pictures)
    req, reasoning = _with_reasoning(state, req, reasoning_format, switches, prompt_ids)
    max_tokens = _max_tokens(state, req, prompt_ids)
    spec, compiled = await constraint(state, wire, plan)
    phase = _engine_phase(state, reasoning, compiled is not None, plan, fmt)
    prediction = _prediction_ids(state, req)
    # a reasoning model thinks first: its choice does not follow the prompt directly
    scored = scored_choices(state, spec, sampling, [prompt_ids]) if phase is None else None
    req, parsed = _parsed_format(state, req, wire, fmt, plan is not None or (recognised and fmt.has_reasoning))
    request_id = new_request_id("chatcmpl")
    specs = await sequences(state, request_id, req, wire, sampling, compiled, [(prompt_ids, max_tokens)],
                            reasoning=phase, prediction_token_ids=prediction, score_choices=scored, media=media)
    return ChatJob(req=req, request_id=request_id, prompt_ids=prompt_ids, specs=specs, tool_plan=plan,
                   echo_prefix=_echo_prefix(req), reasoning=reasoning, truncated=truncated, tool_format=parsed,
                   prompt_tail=state.tokenizer.decode(prompt_ids[-32:]) if parsed else "", wire=wire,
                   scored_choices=list(spec.source) if scored else None)


async def _checked_request(state: ServerState, body: bytes) -> tuple[
        ChatCompletionRequest, dict[str, Any], reasoning_mod.ReasoningFormat | None, reasoning_mod.ReasoningSwitches]:
    """The decoded request (stored conversation first), the wire form, the model's reasoning format
    and the request's reasoning switches."""
    req, wire = decode(state, body, ChatCompletionRequest)
    if req.conversation is not None:
        req = await _with_conversation(state, req)
    reasoning_format = reasoning_mod.detect_reasoning(state.tokenizer, req.chat_template)
    req = admit(state, req, reasoning_model=reasoning_format is not None)
    check_limits(req)
    req = reasoning_mod.apply_deep_research(req, reasoning_format)
    return req, wire, reasoning_format, reasoning_mod.read_switches(req)


def _tool_plan(state: ServerState, req: ChatCompletionRequest) -> tuple[ToolPlan | None, ToolFormat, bool]:
    """The request's tool plan (None without tools) in the model's tool-call format, that format, and
    whether it came from a recognised template or the flag."""
    plan = tool_calls.plan_tools(req)
    fmt, recognised = request_format(state, req.chat_template)
    if plan is not None:
        plan = dataclasses.replace(plan, format_name=fmt.name)
    return plan, fmt, recognised


def _with_reasoning(state: ServerState, req: ChatCompletionRequest, reasoning_format: reasoning_mod.ReasoningFormat | None,
                    switches: reasoning_mod.ReasoningSwitches, prompt_ids: list[int],
                    ) -> tuple[ChatCompletionRequest, reasoning_mod.ReasoningSetup | None]:
    """The reasoning the rendered prompt sets up, with the request decoding special tokens where its
    markers are special."""
    reasoning = reasoning_mod.setup_reasoning(reasoning_format, switches, state.tokenizer, prompt_ids)
    if reasoning is not None and reasoning_mod.keeps_special_tokens(reasoning.format, state.tokenizer):
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the markers are split off the output
    return req, reasoning


def _engine_phase(state: ServerState, reasoning: reasoning_mod.ReasoningSetup | None, constrained: bool,
                  plan: ToolPlan | None, fmt: ToolFormat) -> ReasoningPhase | None:
    """The reasoning segment the engine leaves unconstrained before the answer, or None."""
    harmony_call = plan is not None and plan.mode != "none" and fmt.name == "gpt-oss"
    return reasoning_mod.engine_phase(reasoning, state.tokenizer, constrained=constrained, harmony_tool_call=harmony_call)


def _max_tokens(state: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]) -> int:
    if req.max_completion_tokens is not None:
        return max_tokens_for(state, req.max_completion_tokens, prompt_ids, "max_completion_tokens")
    return max_tokens_for(state, req.max_tokens, prompt_ids, "max_tokens")


def _prediction_ids(state: ServerState, req: ChatCompletionRequest) -> list[int] | None:
    predicted = prediction_text(req.prediction)
    return list(state.tokenizer.encode(predicted, add_special_tokens=False)) if predicted else None


def _parsed_format(state: ServerState, req: ChatCompletionRequest, wire: dict[str, Any], fmt: ToolFormat,
                   parse: bool) -> tuple[ChatCompletionRequest, ToolFormat | None]:
    """The tool-call format the output is parsed in (None: not parsed), with the request decoding
    special tokens where the format's markers are special (unless the request says otherwise)."""
    if not parse:
        return req, None
    if "skip_special_tokens" not in wire and markers_are_special(state, fmt):
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the parser needs the markers
    return req, fmt


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


async def load_pictures(state: ServerState, req: ChatCompletionRequest) -> list:
    """The request's images, fetched and decoded (none for a text-only model: its template
    rendering refuses image parts)."""
    if state.vision is None:
        return []
    refs = state.vision.collect(req.messages)
    if refs and req.truncate_prompt_tokens is not None:
        raise bad_request("'truncate_prompt_tokens' cannot cut a prompt with images", "truncate_prompt_tokens")
    return await state.vision.load(refs, req.max_dynamic_patch) if refs else []


async def render_prompt(state: ServerState, req: ChatCompletionRequest, plan, reasoning_format=None,
                        switches=None, with_images: bool = False) -> list[int]:
    """Apply the chat template (request overrides first) and tokenize, off the event loop.
    ``with_images``: the request's image parts go to the template (a vision-language model)."""
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message", param="messages")
    supports_tools = tool_calls.template_supports_tools(state.tokenizer, req.chat_template)
    slots = _image_slots(state, req) if with_images else None
    messages, tools = tool_calls.render_messages(req.messages, plan, supports_tools, slots)
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


def _image_slots(state: ServerState, req: ChatCompletionRequest) -> tool_calls.ImageSlots:
    """Image parts for a template that renders them, else the family's placeholder in the text."""
    source = template_source(state.tokenizer, req.chat_template)
    if state.vision.template_takes_parts(source):
        return tool_calls.ImageSlots()
    return tool_calls.ImageSlots(placeholder=state.vision.family.placeholder)


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
    return _completion(state, job, await collect_choices(state, job))


def _completion(state: ServerState, job: ChatJob, choices: list[ChoiceResult]) -> ChatCompletion:
    answers = [_chat_choice(state, job, i, choice) for i, choice in enumerate(choices)]
    return ChatCompletion(**response_fields(state, job), choices=answers, usage=_usage(job, choices))


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


class _ChatChunks(ChunkWriter):
    """A chat completion's chunks: deltas with content, reasoning and tool calls split apart."""

    object_name = "chat.completion.chunk"
    job: ChatJob

    def __init__(self, state: ServerState, job: ChatJob) -> None:
        super().__init__(state, job)
        options = job.req.stream_options
        self.continuous = bool(options and options.continuous_usage_stats)
        self.streamers = [
            ChoiceStreamer(job.tool_format, job.tool_plan, job.prompt_tail, ReasoningOutput.of(job.req))
            if job.tool_format is not None else None
            for _ in job.specs
        ]
        self.splitters = [_reasoning_streamer(job) for _ in job.specs]
        self.results = [ChoiceResult() for _ in job.specs]  # the whole answer, for a stored completion

    def opening(self) -> Iterator[dict]:
        for index in range(len(self.job.specs)):
            yield self.chunk(index, {"delta": {"role": "assistant", "content": self.job.echo_prefix}}, None, None)

    def chunks(self, index: int, delta: SequenceDelta) -> Iterator[dict]:
        self.results[index].add(delta)
        usage = self.usage() if self.continuous else None
        logprobs = None
        if self.job.req.logprobs and delta.logprobs:
            logprobs = {"content": msgspec.to_builtins(self.state.token_texts.chat_entries(delta.logprobs))}
        pieces, finish = self._pieces(index, delta, bool(logprobs))
        scored = choice_logprobs(self.job.scored_choices, delta.choice_logprobs) if finish else None
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield self.chunk(index, {"delta": piece}, logprobs if i == 0 else None, finish if last else None,
                             stop_reason=delta.stop_reason if last and finish else None,
                             matched_stop=delta.matched_stop if last and finish else None, usage=usage,
                             scored=scored if last else None, hidden_states=delta.hidden_states if i == 0 else None)

    def _pieces(self, index: int, delta: SequenceDelta, has_logprobs: bool) -> tuple[list[dict], str | None]:
        """The delta's ``delta`` objects (reasoning split off, tool calls parsed; one empty one where
        only logprobs, a finish or hidden states come) and its finish reason."""
        finish = delta.finish_reason
        text, thought = delta.text, ""
        if self.splitters[index] is not None:
            thought, text = self.splitters[index].feed(delta.text, final=bool(finish))
        pieces = [{"content": text}] if text else []
        streamer = self.streamers[index]
        if streamer is not None:
            pieces = streamer.feed(text) if text else []
            if finish:
                pieces += streamer.finish()
                finish = tool_calls.finish_reason(self.job.tool_plan, streamer.has_calls, finish)
        if thought:
            pieces.insert(0, {"reasoning_content": thought})
        if not pieces and (has_logprobs or finish or delta.hidden_states):
            pieces = [{}]
        return pieces, finish

    def usage(self) -> Usage:
        return _usage(self.job, self.results)

    async def finished(self) -> None:
        await persist_chat(self.state, self.job, _completion(self.state, self.job, self.results))  # before the last chunks


stream_chat = _ChatChunks.events  # SSE chunks in OpenAI's format, ending with ``data: [DONE]``
