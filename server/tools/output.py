"""A choice's generated text through its tool-call format's parser, as OpenAI message fields
(non-streamed) or ``choices[].delta`` dicts (streamed); both give the same result."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from server.protocol import AssistantMessage, ToolCall
from server.tools.formats import OutputParser, ParserOptions, ToolFormat
from server.tools.formats.base import Event
from server.tools.parse import make_call, new_call_id
from server.tools.plan import ToolPlan

Delta = dict[str, Any]
log = logging.getLogger("trellis.tools")


def parser_options(fmt: ToolFormat, plan: ToolPlan | None, prompt_tail: str) -> ParserOptions:
    """What the parser may report (calls of the plan's callable tools, none without a plan) and
    what the end of the rendered prompt says (an open reasoning segment, the sub-format)."""
    names = plan.names if plan is not None else frozenset()
    schemas = {tool.name: tool.parameters for tool in plan.tools} if plan is not None else {}
    return ParserOptions(
        names=names,
        in_reasoning=fmt.prompt_in_reasoning(prompt_tail),
        schemas=schemas,
        variant=fmt.variant(prompt_tail),
    )


@dataclass(frozen=True)
class ReasoningOutput:
    """Where reasoning goes (SGLang's switches): ``separate`` false puts it in the content,
    ``stream`` false sends it in one delta once it is complete, ``include`` false drops it."""

    separate: bool = True
    stream: bool = True
    include: bool = True

    @classmethod
    def of(cls, req: Any) -> ReasoningOutput:
        return cls(
            separate=getattr(req, "separate_reasoning", True),
            stream=getattr(req, "stream_reasoning", True),
            include=getattr(req, "include_reasoning", True),
        )

    def route(self, events: list[Event]) -> list[Event]:
        """Reasoning events dropped or turned into content as asked."""
        if not self.include:
            return [e for e in events if e.kind != "reasoning"]
        if not self.separate:
            return [Event("content", e.text) if e.kind == "reasoning" else e for e in events]
        return events


def parse_choice(
    fmt: ToolFormat,
    plan: ToolPlan | None,
    text: str,
    prompt_tail: str,
    reasoning_output: ReasoningOutput = ReasoningOutput(),
) -> tuple[str | None, str | None, list[ToolCall]]:
    """``(content, reasoning_content, tool_calls)`` of a finished generation (``prompt_tail``: the
    end of the rendered prompt). Content is None when calls were made and no text remains."""
    try:
        parsed = fmt.parser(parser_options(fmt, plan, prompt_tail)).parse(text)
    except Exception:  # a parser bug must never turn a finished generation into a 500
        log.exception("tool-call parser '%s' failed; the output is returned as content", fmt.name)
        parsed = [Event("content", text)]
    events = reasoning_output.route(parsed)
    content = "".join(e.text for e in events if e.kind == "content")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning") or None
    calls = [make_call(e.name, e.arguments) for e in events if e.kind == "call"]
    return (None if calls and not content.strip() else content), reasoning, calls


def with_reasoning(message: AssistantMessage, reasoning: str | None) -> AssistantMessage:
    """The message with ``reasoning_content`` set (None leaves it out of the content)."""
    import msgspec

    return msgspec.structs.replace(message, reasoning_content=reasoning) if reasoning is not None else message


class ChoiceStreamer:
    """Text deltas in, OpenAI delta dicts out: ``{"content"}``, ``{"reasoning_content"}``, and
    one ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` per call
    once it is complete (legacy plans: ``{"function_call": {...}}``)."""

    def __init__(
        self,
        fmt: ToolFormat,
        plan: ToolPlan | None,
        prompt_tail: str,
        reasoning_output: ReasoningOutput = ReasoningOutput(),
    ) -> None:
        self.plan = plan
        self.parser: OutputParser = fmt.parser(parser_options(fmt, plan, prompt_tail))
        self.reasoning_output = reasoning_output
        self._held_reasoning = ""
        self._failed = False
        self.call_count = 0
        self._content_sent = False

    @property
    def has_calls(self) -> bool:
        return self.call_count > 0

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._guarded(self.parser.feed, text), final=False) if text else []

    def finish(self) -> list[Delta]:
        return self._deltas(self._guarded(self.parser.finish), final=True)

    def _guarded(self, step, *args: str) -> list[Event]:
        """A parser bug ends parsing: from then on the text goes out as content (never a 500)."""
        if self._failed:
            return [Event("content", args[0])] if args else []
        try:
            return step(*args)
        except Exception:
            log.exception("tool-call parser failed while streaming; the rest is sent as content")
            self._failed = True
            return [Event("content", args[0])] if args else []

    def _deltas(self, events: list[Event], final: bool) -> list[Delta]:
        events = self.reasoning_output.route(events)
        if not self.reasoning_output.stream:
            events = self._hold_reasoning(events, final)
        out: list[Delta] = []
        for event in events:
            if event.kind == "call":
                out.append(self._call(event))
            elif event.text:
                key = "content" if event.kind == "content" else "reasoning_content"
                if out and key in out[-1]:
                    out[-1][key] += event.text
                else:
                    out.append({key: event.text})
        return out

    def _hold_reasoning(self, events: list[Event], final: bool) -> list[Event]:
        """Reasoning collected until something else follows it (or the output ends)."""
        out: list[Event] = []
        for event in events:
            if event.kind == "reasoning":
                self._held_reasoning += event.text
                continue
            if self._held_reasoning:
                out.append(Event("reasoning", self._held_reasoning))
                self._held_reasoning = ""
            out.append(event)
        if final and self._held_reasoning:
            out.append(Event("reasoning", self._held_reasoning))
            self._held_reasoning = ""
        return out

    def _call(self, event: Event) -> Delta:
        self.call_count += 1
        function = {"name": event.name, "arguments": event.arguments}
        if self.plan is not None and self.plan.legacy:
            return {"function_call": function}
        return {"tool_calls": [{"index": self.call_count - 1, "id": new_call_id(), "type": "function", "function": function}]}
