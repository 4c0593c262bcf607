"""Wire format of the OpenAI-compatible API as msgspec Structs.

Requests accept every field that the OpenAI API and the vLLM / SGLang / hosted-platform extensions
define. Unknown fields are rejected (400 naming the field) rather than silently dropped. Responses
are built from Structs too, so encoding is one ``msgspec.json.encode`` call.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Json = dict[str, Any]


class _Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Response(msgspec.Struct, omit_defaults=False, kw_only=True):
    pass


# --------------------------------------------------------------------------- chat messages


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One message of a chat conversation (any role)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Json] | None = None
    name: str | None = None
    tool_calls: list[Json] | None = None
    tool_call_id: str | None = None
    function_call: Json | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    audio: Json | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class _SamplingFields(_Request, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    tags: str | list[str] | None = None
    store: bool | None = None
    # The model router's dialect (accepted on /v0 and /v1).
    drop_params: bool | None = None
    signature: str | None = None
    use_custom_keys: bool | None = None
    region: str | None = None
    log_query_body: bool | None = None
    log_response_body: bool | None = None
    priority: int | None = None
    request_id: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    truncate_prompt_tokens: int | None = None
    # TensorRT-LLM-style and SGLang generation extras.
    bad: str | list[str] | None = None
    bad_words: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    top_p_min: float | None = None
    top_p_decay: float | None = None
    top_p_reset_ids: int | list[int] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    return_cached_tokens_details: bool = False
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None  # SGLang: handed to the custom_logit_processor
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    # Engine-steering extensions (SGLang / vLLM): LoRA adapter, hidden states, MoE routing.
    lora_path: str | None = None
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    speculation: str | None = None  # "auto" (default: the server's --speculation) or "off": no drafts of Trellis's own
    # Structured outputs (OpenAI, vLLM legacy + current, SGLang).
    response_format: Json | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: Json | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Any = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    conversation: str | dict[str, Any] | None = None
    store_reasoning: bool | None = None
    separate_reasoning: bool = True  # SGLang: false keeps reasoning text in content
    stream_reasoning: bool = True  # SGLang: false sends reasoning_content once, when it is complete
    include_reasoning: bool = True  # false drops reasoning from the answer
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Json] | None = None
    tool_choice: str | Json | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Json] | None = None
    function_call: str | Json | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    documents: list[Json] | None = None
    reasoning_effort: str | None = None
    # Reasoning switches (server/reasoning.py): a hosted platform's top-level switch, and the
    # reasoning budget under its own name and vLLM's / SGLang's.
    enable_thinking: bool | None = None
    max_reasoning_tokens: int | None = None
    thinking_token_budget: int | None = None
    thinking_budget: int | None = None
    modalities: list[str] | None = None
    audio: Json | None = None
    prediction: Json | None = None
    web_search_options: Json | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    deep_research: Any = None
    add_special_tokens: bool = False


class CompletionRequest(_SamplingFields, kw_only=True):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


# --------------------------------------------------------------------------- responses


class TopLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response, kw_only=True):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(_Response, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokensDetails(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``usage.prompt_tokens_details``: ``cached_tokens`` (served from the prefix cache) and the
    prompt tokens ``truncate_prompt_tokens`` removed, when it removed any."""

    cached_tokens: int
    truncated_tokens: int | None = None


class CompletionTokensDetails(_Response, kw_only=True):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # drafts Trellis found itself (prompt lookup), verified like a prediction: set when any was fed
    accepted_draft_tokens: int | msgspec.UnsetType = msgspec.UNSET
    rejected_draft_tokens: int | msgspec.UnsetType = msgspec.UNSET


class Usage(msgspec.Struct, omit_defaults=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # set with a ``prediction`` or drafts


class ChoiceLogprob(_Response, kw_only=True):
    """One choice's probability (``logprobs`` with ``guided_choice``/``structured_outputs.choice``)."""

    choice: str
    logprob: float


class FunctionCall(_Response, kw_only=True):
    name: str
    arguments: str


class ToolCall(_Response, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(_Response, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # only on reasoning models


class ChatChoice(_Response, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None
    choice_logprobs: list[ChoiceLogprob] | None = None
    hidden_states: list[list[float]] | msgspec.UnsetType = msgspec.UNSET  # per output token, when asked


class ChatCompletion(_Response, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | msgspec.UnsetType = msgspec.UNSET  # echoed when the request set one


class CompletionChoice(_Response, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None
    choice_logprobs: list[ChoiceLogprob] | None = None
    hidden_states: list[list[float]] | msgspec.UnsetType = msgspec.UNSET  # per output token, when asked


class Completion(_Response, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | msgspec.UnsetType = msgspec.UNSET  # echoed when the request set one


class ModelCard(_Response, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "trellis"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorBody(_Response, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response, kw_only=True):
    """OpenAI's ``error`` object plus the hosted platform's top-level ``code``, ``message``, ``request_id``."""

    error: ErrorBody
    code: str | None
    message: str
    request_id: str | None
