"""Reasoning models: detection from the chat template, the request's switches, and the engine phase.

"Free to think, strict to answer": on a model whose template has a reasoning segment, a request's
constraint (json_schema, regex, choice, grammar, tool calls) applies only after the segment ends;
the reasoning itself is free but bounded by a budget. Two families are recognised:

* ``<think>`` … ``</think>`` (Qwen3, DeepSeek-R1 distills, GLM-4.x, Kimi, SmolLM3): the template
  mentions both markers. Qwen3's template switches thinking off with ``enable_thinking=false`` by
  pre-filling an empty ``<think>\\n\\n</think>\\n\\n``; DeepSeek-R1's generation prompt pre-fills
  ``<think>\\n`` (the segment is already open).
* harmony (gpt-oss; format described at https://cookbook.openai.com/articles/openai-harmony): the
  model writes ``<|channel|>analysis<|message|>`` … ``<|end|>``, then the answer after
  ``<|start|>assistant<|channel|>final<|message|>``; the template puts ``Reasoning: low|medium|high``
  in the system message from its ``reasoning_effort`` variable.

Switches: top-level ``enable_thinking``, ``chat_template_kwargs`` (``enable_thinking``, ``thinking``),
``reasoning_effort`` (low/medium/high, passed to templates that read it), and a hard budget
``max_reasoning_tokens`` (aliases ``thinking_token_budget`` as vLLM names it and ``thinking_budget`` as
SGLang names it). A switch that has no effect on the loaded model is accepted and named in the
``x-trellis-ignored`` response header, never dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from server.context import request_log
from server.engine.sequence import ReasoningPhase
from server.errors import bad_request
from server.memory import DERIVED_TEXT
from server.render import template_source

IGNORED_HEADER = "x-trellis-ignored"
EFFORTS = ("low", "medium", "high")
BUDGET_FIELDS = ("max_reasoning_tokens", "thinking_token_budget", "thinking_budget")
_TAIL_TOKENS = 48  # how much of the prompt's end is decoded to see whether it opened or closed the segment

State = Literal["open", "closed", "model"]


@dataclass(frozen=True)
class ReasoningFormat:
    """A model family's reasoning markers (as text) and the template switches it reads."""

    family: Literal["think", "harmony"]
    start: str
    end: str
    answer_prefix: str  # forced after the end marker, before the answer's first constrained token
    reads_enable_thinking: bool = False
    reads_thinking: bool = False
    reads_effort: bool = False

    @property
    def reads_thinking_switch(self) -> bool:
        return self.reads_enable_thinking or self.reads_thinking

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.start, self.end, self.answer_prefix) if m.strip())


THINK_START, THINK_END = "<think>", "</think>"
HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_END = "<|end|>"
HARMONY_ANSWER = "<|start|>assistant<|channel|>final<|message|>"


def detect_reasoning(tokenizer: Any, chat_template: str | None = None) -> ReasoningFormat | None:
    """The reasoning format of the template in use, or None (e.g. the default SmolLM2 model)."""
    source = template_source(tokenizer, chat_template)
    has_channel = "<|channel|>" in source and len(tokenizer.encode("<|channel|>", add_special_tokens=False)) == 1
    return _detect(source, has_channel)


@DERIVED_TEXT.cached
def _detect(source: str, has_channel_token: bool) -> ReasoningFormat | None:
    switches = {
        "reads_enable_thinking": bool(re.search(r"\benable_thinking\b", source)),
        "reads_thinking": bool(re.search(r"\bthinking\b", source)),
        "reads_effort": bool(re.search(r"\breasoning_effort\b", source)),
    }
    if has_channel_token and "<|channel|>" in source and "analysis" in source and "final" in source:
        return ReasoningFormat("harmony", HARMONY_START, HARMONY_END, HARMONY_ANSWER, **switches)
    if THINK_START in source and THINK_END in source:
        return ReasoningFormat("think", THINK_START, THINK_END, "\n\n", **switches)
    return None


# --------------------------------------------------------------------------- request switches


@dataclass(frozen=True)
class ReasoningSwitches:
    """The request's reasoning fields, validated (not yet tied to a model)."""

    thinking: bool | None  # None: the template's default
    effort: str | None
    budget: int | None
    given: tuple[str, ...]  # names of the fields the request set, for the ignored header


def read_switches(req: Any) -> ReasoningSwitches:
    """Validate ``enable_thinking``, ``chat_template_kwargs``' thinking switches, ``reasoning_effort``
    and the budget fields (400 naming the field)."""
    given: list[str] = []
    thinking = _thinking_switch(req)
    if req.enable_thinking is not None:
        given.append("enable_thinking")
    effort = req.reasoning_effort
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}",
                              param="reasoning_effort", code="invalid_value")
        given.append("reasoning_effort")
    budget = _budget(req)
    if budget is not None:
        given.append(next(name for name in BUDGET_FIELDS if getattr(req, name) is not None))
    return ReasoningSwitches(thinking, effort, budget, tuple(given))


def _thinking_switch(req: Any) -> bool | None:
    kwargs = req.chat_template_kwargs or {}
    values = {name: kwargs[name] for name in ("enable_thinking", "thinking") if name in kwargs}
    for name, value in values.items():
        if not isinstance(value, bool):
            raise bad_request(f"'chat_template_kwargs.{name}' must be a boolean", param=f"chat_template_kwargs.{name}")
    if req.enable_thinking is not None:
        values["top"] = req.enable_thinking
    if len(set(values.values())) > 1:
        raise bad_request("'enable_thinking' contradicts chat_template_kwargs' thinking switch",
                          param="enable_thinking")
    return next(iter(values.values()), None)


def _budget(req: Any) -> int | None:
    values = {name: getattr(req, name) for name in BUDGET_FIELDS if getattr(req, name) is not None}
    for name, value in values.items():
        if value < 0:
            raise bad_request(f"'{name}' must be >= 0, got {value}", param=name)
    if len(set(values.values())) > 1:
        names = sorted(values)
        raise bad_request(f"'{names[0]}' and '{names[1]}' disagree; give one budget", param=names[1])
    return next(iter(values.values()), None)


def template_kwargs(fmt: ReasoningFormat | None, switches: ReasoningSwitches, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` with the request's switches added the way the template reads them."""
    if fmt is None:
        return kwargs
    out = dict(kwargs)
    if switches.thinking is not None:
        if fmt.reads_enable_thinking:
            out.setdefault("enable_thinking", switches.thinking)
        if fmt.reads_thinking:
            out.setdefault("thinking", switches.thinking)
    if switches.effort is not None and fmt.reads_effort:
        out.setdefault("reasoning_effort", switches.effort)
    return out


# --------------------------------------------------------------------------- after rendering


@dataclass(frozen=True)
class ReasoningSetup:
    """A request's reasoning after its prompt was rendered: the format and whether the prompt left
    the segment open (the output starts inside it), closed it, or left it to the model."""

    format: ReasoningFormat
    state: State
    budget: int | None

    @property
    def active(self) -> bool:
        return self.state != "closed"

    @property
    def starts_inside(self) -> bool:
        return self.state == "open"


def prompt_state(fmt: ReasoningFormat, tokenizer: Any, prompt_ids: list[int]) -> State:
    """Whether the rendered prompt ends inside the reasoning segment, after it, or before it."""
    tail = tokenizer.decode(prompt_ids[-_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
    closing = fmt.answer_prefix.strip() or fmt.end
    if tail.endswith(closing) or tail.endswith(fmt.end):
        return "closed"
    last_start = tail.rfind(fmt.start)
    if last_start >= 0 and tail.rfind(fmt.end) < last_start:
        return "open"
    return "model"


def setup_reasoning(fmt: ReasoningFormat | None, switches: ReasoningSwitches, tokenizer: Any,
                    prompt_ids: list[int]) -> ReasoningSetup | None:
    """The request's reasoning, or None; names the switches that had no effect (response header)."""
    ignored: list[str] = []
    setup = None
    if fmt is None:
        ignored.extend(switches.given)
    else:
        setup = ReasoningSetup(fmt, prompt_state(fmt, tokenizer, prompt_ids), switches.budget)
        if "enable_thinking" in switches.given and not fmt.reads_thinking_switch:
            ignored.append("enable_thinking")
        if "reasoning_effort" in switches.given and not fmt.reads_effort:
            ignored.append("reasoning_effort")
        if switches.budget is not None and not setup.active:
            ignored.extend(name for name in switches.given if name in BUDGET_FIELDS)
    note_ignored(ignored)
    return setup if setup is not None and setup.active else None


def engine_phase(
    setup: ReasoningSetup | None, tokenizer: Any, constrained: bool, *, harmony_tool_call: bool = False
) -> ReasoningPhase | None:
    """The engine's reasoning phase: only needed when there is a constraint to hold back or a
    budget to enforce (otherwise the model thinks and answers on its own). ``harmony_tool_call``:
    the answer may be a call on harmony's commentary channel (gpt-oss tool format), so only the
    new assistant message is forced and the tool constraint writes the channel header."""
    if setup is None or not (constrained or setup.budget is not None):
        return None
    fmt = setup.format
    answer_prefix = fmt.answer_prefix
    if harmony_tool_call and fmt.family == "harmony":
        answer_prefix = answer_prefix.split("<|channel|>")[0]  # "<|start|>assistant"

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    end_ids = encode(fmt.end)
    return ReasoningPhase(
        end_ids=end_ids,
        end_text=fmt.end if len(end_ids) > 1 else "",  # no single token: match the text too
        start_ids=() if setup.starts_inside else encode(fmt.start),
        answer_prefix_ids=encode(answer_prefix),
        budget=setup.budget,
    )


def keeps_special_tokens(fmt: ReasoningFormat, tokenizer: Any) -> bool:
    """Whether the markers are special tokens (then the output must keep them to be split)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    special.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return any(token in special for token in (fmt.start, fmt.end, "<|channel|>"))


def note_ignored(names: list[str]) -> None:
    """Record accepted-but-ineffective fields for the ``x-trellis-ignored`` header and the log."""
    if names:
        fields = request_log()
        fields["ignored_params"] = [*fields.get("ignored_params", []), *names]


# --------------------------------------------------------------------------- the response (minimal)


def split_reasoning(text: str, fmt: ReasoningFormat, starts_inside: bool, *, final: bool = True) -> tuple[str, str]:
    """``(reasoning, content)`` of a complete (or, with ``final=False``, partial) output; markers
    appear in neither. A partial output returns only what cannot change as more text arrives."""
    if not final:
        text = text[: len(text) - _partial_marker_len(text, fmt.markers)]
    if not starts_inside:
        head = text.lstrip()
        if head.startswith(fmt.start):
            text = head[len(fmt.start):]
        elif not final and (not head or fmt.start.startswith(head)):
            return "", ""
        else:
            return "", _strip_answer_prefix(text, fmt)
    reasoning, found, after = text.partition(fmt.end)
    if not found:
        return reasoning, ""
    return reasoning, _strip_answer_prefix(after, fmt)


def _strip_answer_prefix(text: str, fmt: ReasoningFormat) -> str:
    prefix = fmt.answer_prefix.strip()
    head = text.lstrip()
    if prefix and head.startswith(prefix):
        head = head[len(prefix):].lstrip()
    return head


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class ReasoningStreamSplitter:
    """Streams ``split_reasoning``: each ``feed`` returns the new (reasoning, content) text."""

    def __init__(self, fmt: ReasoningFormat, starts_inside: bool) -> None:
        self.fmt = fmt
        self.starts_inside = starts_inside
        self._text = ""
        self._sent = ("", "")

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        self._text += text
        reasoning, content = split_reasoning(self._text, self.fmt, self.starts_inside, final=final)
        sent_reasoning, sent_content = self._sent
        if not (reasoning.startswith(sent_reasoning) and content.startswith(sent_content)):
            return "", ""  # never retract what was sent (cannot happen with a held-back tail)
        self._sent = (reasoning, content)
        return reasoning[len(sent_reasoning):], content[len(sent_content):]


# --------------------------------------------------------------------------- deep research

RESEARCH_PROMPT = (
    "You are a research assistant. Think the question through before you answer: break it into "
    "parts, gather what you need with the tools you are given (when there are any), weigh the "
    "evidence, and say where you are unsure. Then give a complete, well-organised answer."
)


def apply_deep_research(req: Any, fmt: "ReasoningFormat | None") -> Any:
    """``deep_research: true`` (the hosted platform's switch): a reasoning model thinks (thinking on
    unless the request turned it off) with a research system prompt, the request's tools kept.
    400 when the value is not a boolean or the model has no reasoning mode."""
    import msgspec

    from server.protocol import ChatMessage

    value = req.deep_research
    if value is None or value is False:
        return req
    if value is not True:
        raise bad_request("'deep_research' must be a boolean", param="deep_research")
    if fmt is None:
        raise bad_request("'deep_research' needs a reasoning model; the loaded model has no reasoning mode",
                          param="deep_research", code="unsupported_parameter")
    messages = list(req.messages)
    first = messages[0] if messages else None
    if first is not None and first.role in ("system", "developer") and isinstance(first.content, str):
        messages[0] = msgspec.structs.replace(first, content=f"{RESEARCH_PROMPT}\n\n{first.content}")
    else:
        messages.insert(0, ChatMessage(role="system", content=RESEARCH_PROMPT))
    thinking = True if req.enable_thinking is None and not _thinking_in_kwargs(req) else req.enable_thinking
    return msgspec.structs.replace(req, messages=messages, enable_thinking=thinking, deep_research=None)


def _thinking_in_kwargs(req: Any) -> bool:
    kwargs = req.chat_template_kwargs or {}
    return "enable_thinking" in kwargs or "thinking" in kwargs

