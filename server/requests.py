"""Decoding and validating request bodies into what the engine needs.

Every problem becomes an :class:`APIError` naming the field, so the client always learns what to
fix; fields that would change behaviour but are not implemented are refused, never ignored.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any, TypeVar

import msgspec
import regex

from sampler import SamplingParams
from sampler.custom import CustomProcessorError, load_custom_processor
from server.context import request_log
from server.dialect import convert_dropping_unknown, drops_params, normalise_tags, on_router_dialect
from server.errors import APIError, bad_request, not_implemented
from server.protocol import ChatCompletionRequest, CompletionRequest, CompletionTokensDetails, PromptTokensDetails, Usage

T = TypeVar("T", ChatCompletionRequest, CompletionRequest)

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64
MAX_MESSAGES = 1024
MAX_STOP = 32
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_PROMPTS_TIMES_N = 256
MAX_TEMPERATURE = 4.0  # OpenAI documents 0-2; the TensorRT-LLM-style hosted API up to 4
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
_dropping: ContextVar[bool] = ContextVar("trellis_dropping_params", default=False)
_FIELD_AT = re.compile(r"at `\$(.*)`$")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


def decode_request(body: bytes, cls: type[T]) -> tuple[T, dict[str, Any]]:
    """Parse JSON, merge a literal ``extra_body`` object, and convert to ``cls``.

    Returns the typed request and the merged plain dict (the wire view the constraint parser reads).
    """
    data = parse_json_body(body)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    extra = data.pop("extra_body", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise bad_request("'extra_body' must be an object", param="extra_body")
        clashes = sorted(k for k in extra if k in data and data[k] != extra[k])
        if clashes:
            raise bad_request(f"'{clashes[0]}' given both at top level and in extra_body", param=clashes[0])
        data.update(extra)
    normalise_tags(data)
    dropping = drops_params(data)
    _dropping.set(dropping)
    try:
        if not dropping:
            return msgspec.convert(data, cls), data
        req, dropped = convert_dropping_unknown(data, cls)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from exc
    note_dropped(dropped)
    return req, data


def note_dropped(names: list[str]) -> None:
    """Record dropped parameters for the response header and the request log."""
    if names:
        fields = request_log()
        fields["dropped_params"] = [*fields.get("dropped_params", []), *names]


def parse_json_body(body: bytes) -> Any:
    """The body as JSON; 400 ``invalid_json`` for bad JSON, bad UTF-8 or nesting over the bound."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        data = None
    if data is None or json_depth(data) > MAX_JSON_DEPTH:
        raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return data


def json_depth(value: Any) -> int:
    """Deepest nesting of arrays/objects in ``value`` (iterative: safe on any depth)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def check_limits(req: ChatCompletionRequest | CompletionRequest, n_prompts: int = 1) -> None:
    """Bounds on the request's sizes, each a 400 naming the field."""
    if isinstance(req, ChatCompletionRequest):
        _at_most(len(req.messages), MAX_MESSAGES, "messages")
        _at_most(len(req.tools or ()) + len(req.functions or ()), MAX_TOOLS, "tools")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    _at_most(len(stops), MAX_STOP, "stop")
    _at_most(len(req.stop_token_ids or ()), MAX_LOGIT_BIAS, "stop_token_ids")
    _at_most(len(req.logit_bias or {}), MAX_LOGIT_BIAS, "logit_bias")
    if n_prompts * req.n > MAX_PROMPTS_TIMES_N:
        raise bad_request(
            f"{n_prompts} prompts x n={req.n} is {n_prompts * req.n} sequences; at most {MAX_PROMPTS_TIMES_N} per request",
            param="n",
        )


def _at_most(count: int, limit: int, name: str) -> None:
    if count > limit:
        raise bad_request(f"'{name}' has {count} entries; at most {limit} are allowed", param=name)


def _validation_error(exc: msgspec.ValidationError) -> APIError:
    text = str(exc)
    unknown = _UNKNOWN_FIELD.search(text)
    where = _FIELD_AT.search(text)
    path = _json_path_to_param(where.group(1)) if where else ""
    if unknown:
        name = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return APIError(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    message = _FIELD_AT.sub("", text).strip().rstrip("-").strip()
    if "missing required field" in message.lower():
        missing = re.search(r"`([^`]*)`", message)
        name = (f"{path}.{missing.group(1)}" if path else missing.group(1)) if missing else path
        return APIError(f"missing required field '{name}'", param=name or None, code="missing_required_parameter")
    return APIError(f"invalid value for '{path}': {message}", param=path or None, code="invalid_type")


def _json_path_to_param(path: str) -> str:
    """``.messages[0].role`` → ``messages[0].role``."""
    return path[1:] if path.startswith(".") else path


# --------------------------------------------------------------------------- field checks


_REFUSALS = {
    "custom_logit_processor": "'custom_logit_processor' is client code run inside the server; this server "
    "refuses it unless started with --enable-custom-logit-processor",
    "max_dynamic_patch": "'max_dynamic_patch' sets image tiling, but the loaded model is text-only",
    "min_dynamic_patch": "'min_dynamic_patch' sets image tiling, but the loaded model is text-only",
    "deep_research": "'deep_research' needs a reasoning model; the loaded model has no reasoning mode",
    "return_routed_experts": "'return_routed_experts' needs a mixture-of-experts model; the loaded model is dense "
    "and routes no experts",
}


def reject_unimplemented(req: T, *, custom_logit_processor_enabled: bool = False, reasoning_model: bool = False,
                         image_tiling: str | None = None) -> T:
    """Refuse behaviour-changing fields this server does not implement (or, with ``drop_params``,
    drop them and say so); returns the request without dropped fields. ``image_tiling``: None for
    a text-only model, "" for a vision-language model that does not tile, "tiles" for one that does."""
    tiles = image_tiling == "tiles"
    unsupported = {
        "use_beam_search": bool(req.use_beam_search),
        "length_penalty": req.length_penalty is not None,
        "custom_logit_processor": req.custom_logit_processor is not None and not custom_logit_processor_enabled,
        "max_dynamic_patch": req.max_dynamic_patch is not None and not tiles,
        "min_dynamic_patch": req.min_dynamic_patch is not None and not tiles,
        "return_routed_experts": bool(req.return_routed_experts),
    }
    if isinstance(req, ChatCompletionRequest):
        unsupported.update(
            audio=req.audio is not None,
            web_search_options=req.web_search_options is not None,
            deep_research=req.deep_research not in (None, False) and not reasoning_model,
            modalities=req.modalities is not None and req.modalities != ["text"],
        )
    else:
        unsupported["suffix"] = bool(req.suffix)
    present = [name for name, given in unsupported.items() if given]
    if req.best_of is not None and req.best_of != req.n:
        present.append("best_of")
    if "custom_logit_processor" in present and req.custom_params is not None:
        present.append("custom_params")  # only meaningful to the processor
    if present and _dropping.get():
        note_dropped(present)
        defaults = {f.name: f.default for f in msgspec.structs.fields(req) if f.name in present}
        return msgspec.structs.replace(req, **defaults)
    if "best_of" in present:
        raise bad_request("'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    if present:
        name = present[0]
        message = _REFUSALS.get(name)
        if name.endswith("_dynamic_patch") and image_tiling is not None:
            message = f"'{name}' sets image tiling, but the loaded model does not cut images into tiles"
        if message is None:
            raise not_implemented(name)
        raise bad_request(message, param=name, code="unsupported_parameter")
    if tiles:
        _check_tiles(req.max_dynamic_patch, req.min_dynamic_patch)
    return req


def _check_tiles(most: int | None, least: int | None) -> None:
    """SGLang's tile counts on a tiling vision model: ``max_dynamic_patch`` at least 1; the tiles
    follow from the image's size, so ``min_dynamic_patch`` can only be 1."""
    if most is not None and most < 1:
        raise bad_request("'max_dynamic_patch' must be at least 1", param="max_dynamic_patch")
    if least is not None and least != 1:
        raise bad_request("'min_dynamic_patch' can only be 1 on this model: it cuts an image into as many tiles as "
                          "its size needs (up to 'max_dynamic_patch'), never more", param="min_dynamic_patch")


def prediction_text(prediction: Any) -> str | None:
    """The text of OpenAI's ``prediction: {"type": "content", "content": str | [text parts]}``."""
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise bad_request("'prediction' must be {\"type\": \"content\", \"content\": ...}", param="prediction.type")
    unknown = set(prediction) - {"type", "content"}
    if unknown:
        raise bad_request(f"unknown field in 'prediction': {sorted(unknown)[0]}", param="prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("prediction content parts must be {\"type\": \"text\", \"text\": str}",
                                  param=f"prediction.content[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request("'prediction.content' must be a string or a non-empty list of text parts",
                      param="prediction.content")


def choice_token_ids(spec: Any, want_logprobs: bool, tokenizer, prompt_lens: list[int], max_model_len: int):
    """Token ids of each choice to score (``guided_choice``/``structured_outputs.choice`` with
    ``logprobs``), or None. A choice is scored as the tokenizer's own encoding of its text."""
    if spec is None or spec.kind != "choice" or not want_logprobs:
        return None
    choices = [list(tokenizer.encode(text, add_special_tokens=False)) for text in spec.source]
    for i, ids in enumerate(choices):
        if not ids:
            raise bad_request("an empty choice cannot be scored (logprobs with choices)", param=f"{spec.param}[{i}]")
    if max(prompt_lens) + max(len(ids) for ids in choices) > max_model_len:
        raise bad_request("the prompt and the longest choice exceed the context window", param=spec.param)
    return choices


def check_scoring_without_processor(scored, params: SamplingParams) -> None:
    """Scored choices are ranked on the raw model probabilities, which a ``custom_logit_processor``
    would not touch: refuse the pair rather than ignore the processor."""
    if scored is not None and params.custom_processor is not None:
        raise bad_request("'custom_logit_processor' cannot steer choices scored with logprobs (guided_choice with "
                          "logprobs ranks the raw model probabilities); drop one of them",
                          param="custom_logit_processor")


def _check_range(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high):
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", param=name)


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    vocab_size: int,
    eos_token_ids: frozenset[int],
    logprobs: bool,
    top_logprobs: int,
    tokenizer=None,
) -> SamplingParams:
    """Validate the sampling fields and turn them into :class:`SamplingParams` (``tokenizer``
    encodes ``bad`` / ``bad_words`` phrases)."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"'n' must be between 1 and {MAX_N}, got {req.n}", param="n")
    _check_range(req.temperature, "temperature", 0.0, MAX_TEMPERATURE)
    _check_range(req.top_p, "top_p", 0.0, 1.0)
    if req.top_p is not None and req.top_p <= 0.0:
        raise bad_request("'top_p' must be greater than 0", param="top_p")
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.repetition_penalty, "repetition_penalty", 1e-6, 10.0)
    top_k = req.top_k if req.top_k is not None else -1
    if top_k < -1:
        raise bad_request(f"'top_k' must be -1 (off) or positive, got {top_k}", param="top_k")
    if req.min_tokens < 0:
        raise bad_request("'min_tokens' must be >= 0", param="min_tokens")
    stop_ids = _token_ids(req.stop_token_ids or [], "stop_token_ids", vocab_size)
    decay, floor, resets = _top_p_decay(req, vocab_size)
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        min_tokens=req.min_tokens,
        banned_until_min_tokens=frozenset(stop_ids) | (frozenset() if req.ignore_eos else eos_token_ids),
        seed=req.seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        bad_words=_bad_words(req, tokenizer, vocab_size),
        top_p_decay=decay,
        top_p_min=floor,
        top_p_reset_ids=resets,
        custom_processor=_custom_processor(req),
        custom_params=req.custom_params,
    )


def _custom_processor(req):
    """SGLang's serialized ``custom_logit_processor`` (the caller has checked the server allows it);
    ``custom_params`` without one is a 400, as it would do nothing."""
    if req.custom_logit_processor is None:
        if req.custom_params is not None:
            raise bad_request("'custom_params' is only read by a 'custom_logit_processor', and the request has none",
                              param="custom_params")
        return None
    try:
        return load_custom_processor(req.custom_logit_processor)
    except CustomProcessorError as exc:
        raise bad_request(f"'custom_logit_processor' cannot be loaded: {exc}", param="custom_logit_processor",
                          code="invalid_custom_logit_processor") from None


def _top_p_decay(req, vocab_size: int) -> tuple[float, float, frozenset[int]]:
    """TensorRT-LLM's decaying top-p fields (defaults: no decay, floor 1e-6, no reset id)."""
    for name in ("top_p_decay", "top_p_min"):
        value = getattr(req, name)
        if value is not None and not 0.0 < value <= 1.0:
            raise bad_request(f"'{name}' must be greater than 0 and at most 1, got {value}", param=name)
    resets = req.top_p_reset_ids
    resets = [resets] if isinstance(resets, int) else (resets or [])
    reset_ids = _token_ids(resets, "top_p_reset_ids", vocab_size)
    decay = 1.0 if req.top_p_decay is None else req.top_p_decay
    return decay, 1e-6 if req.top_p_min is None else req.top_p_min, reset_ids


def _bad_words(req, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """``bad`` / ``bad_words`` phrases as token sequences (each phrase as the tokenizer encodes it
    alone and after a space) plus ``bad_token_ids`` as one-token sequences."""
    phrases: list[tuple[str, str]] = []
    for name in ("bad", "bad_words"):
        value = getattr(req, name)
        for phrase in [value] if isinstance(value, str) else (value or []):
            if not phrase or len(phrase) > MAX_BAD_WORD_CHARS:
                raise bad_request(f"'{name}' entries must have 1 to {MAX_BAD_WORD_CHARS} characters", param=name)
            phrases.append((name, phrase))
    _at_most(len(phrases) + len(req.bad_token_ids or ()), MAX_BAD_WORDS, "bad_words")
    words: dict[tuple[int, ...], None] = {}
    if phrases and tokenizer is None:
        raise ValueError("bad words need the tokenizer")
    for name, phrase in phrases:
        variants = (phrase, phrase.lstrip(), " " + phrase.lstrip()) if phrase.strip() else (phrase,)
        for variant in dict.fromkeys(variants):
            ids = tuple(tokenizer(variant, add_special_tokens=False).input_ids)
            if ids:
                words[ids] = None
    for token in sorted(_token_ids(req.bad_token_ids or [], "bad_token_ids", vocab_size)):
        words[(token,)] = None
    return tuple(words)


def _token_ids(ids: list[int], name: str, vocab_size: int) -> frozenset[int]:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise bad_request(f"'{name}[{i}]' = {token} is not a token id (vocabulary size {vocab_size})", param=name)
    return frozenset(ids)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias value for {token} must be between -100 and 100", param="logit_bias")
        out[token] = float(value)
    return out


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return tuple(stops)


def stop_regexes(stop_regex: str | list[str] | None) -> tuple[Any, ...]:
    """SGLang's ``stop_regex`` compiled (Python ``regex`` syntax); 400 naming it when a pattern is
    empty, invalid or matches the empty string (it would stop before the first token)."""
    patterns = [stop_regex] if isinstance(stop_regex, str) else (stop_regex or [])
    _at_most(len(patterns), MAX_STOP, "stop_regex")
    compiled = []
    for i, pattern in enumerate(patterns):
        if not pattern:
            raise bad_request("stop_regex patterns must not be empty", param="stop_regex")
        try:
            compiled.append(regex.compile(pattern))
        except (regex.error, OverflowError, RecursionError) as exc:
            raise bad_request(f"stop_regex[{i}] is not a valid regular expression: {exc}", param="stop_regex") from None
        if compiled[-1].fullmatch("") is not None:
            raise bad_request(f"stop_regex[{i}] matches the empty string", param="stop_regex")
    return tuple(compiled)


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> tuple[list[int], int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` tokens (-1: the context length);
    returns (prompt, tokens removed)."""
    if keep is None:
        return ids, 0
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise bad_request(f"'truncate_prompt_tokens' must be -1 or between 1 and {max_model_len}, got {keep}",
                          param="truncate_prompt_tokens")
    removed = max(0, len(ids) - keep)
    return ids[removed:], removed


def clamps_max_tokens(max_tokens_overflow: str) -> bool:
    """``max_tokens`` beyond the context is clamped on ``/v0`` (the hosted API's rule) and on
    ``/v1`` with ``--max-tokens-overflow clamp``; otherwise it is OpenAI's 400."""
    return on_router_dialect() or max_tokens_overflow == "clamp"


def note_clamped(requested: int, used: int) -> None:
    """A clamped ``max_tokens``, as ``requested->used``, for the response header and the log."""
    fields = request_log()
    entry = f"{requested}->{used}"
    if entry not in fields.setdefault("clamped_max_tokens", []):
        fields["clamped_max_tokens"].append(entry)


def note_truncated(removed: int) -> None:
    """Prompt tokens ``truncate_prompt_tokens`` removed, for the response header and the log."""
    if removed:
        fields = request_log()
        fields["truncated_prompt_tokens"] = fields.get("truncated_prompt_tokens", 0) + removed


def build_usage(
    prompt: int, completion: int, *, cached_details: bool, truncated: int,
    completion_details: CompletionTokensDetails | None = None, cached: int = 0,
) -> Usage:
    """``usage``; ``prompt_tokens_details`` when a prompt prefix came from the prefix cache
    (``cached`` tokens), when asked for (``return_cached_tokens_details``) or when the prompt
    was truncated."""
    details = None
    if cached_details or truncated or cached:
        details = PromptTokensDetails(cached_tokens=cached, truncated_tokens=truncated or None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details, completion_tokens_details=completion_details)


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str, *, clamp: bool = False
) -> int:
    """Completion budget: the request's limit, bounded by the context; 400 when it cannot fit
    (or, with ``clamp``, as many tokens as fit)."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens. Shorten the prompt.",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return room
    if requested < 1:
        raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param)
    if requested > room and clamp:
        note_clamped(requested, room)
        return room
    if requested > room:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Reduce the prompt or '{param}'.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def logprob_settings(logprobs: bool | int | None, top_logprobs: int | None, chat: bool) -> tuple[bool, int]:
    """(want logprobs, how many alternatives) for chat's bool+int or completions' int form."""
    if chat:
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if top_logprobs and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        return bool(logprobs), top_logprobs or 0
    if logprobs is None:
        return False, 0
    if not 0 <= int(logprobs) <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    return True, int(logprobs)
