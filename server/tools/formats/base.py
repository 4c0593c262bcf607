"""The seam between Trellis and one model family's tool-call format.

A :class:`ToolFormat` knows three things about its family:

* how to recognise it (:meth:`ToolFormat.detect` on the chat template text and special tokens);
* how to read the model's output: :meth:`ToolFormat.parser` returns an incremental
  :class:`OutputParser` -- feed it text deltas, get :class:`Event` s (content, reasoning, one
  complete tool call) back, then ``finish()``. The events are the same however the text is split;
  a call is only ever reported once it is complete and well-formed, anything else is content;
* how to constrain generation: :meth:`ToolFormat.structural_tag` gives the xgrammar structural tag
  for a :class:`~server.tools.plan.ToolPlan` ("required", named, ``parallel_tool_calls: false``,
  and "auto" triggered on the family's call-opening marker).

Most families share one shape -- optional reasoning between think markers, free text, and call
*blocks* that start with an opening marker -- so :class:`BlockParser` implements the streaming
machinery once and a family supplies only its markers and two small functions: where a block
ends (:meth:`BlockParser.block_end`) and what calls it holds (:meth:`BlockParser.parse_block`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from server.tools.plan import ToolPlan

EventKind = Literal["content", "reasoning", "call"]
NEED_MORE = None  # block_end: the block is not complete yet


@dataclass(frozen=True)
class Event:
    """One piece of parsed output: ``text`` for content/reasoning, ``name``/``arguments`` (JSON
    object text) for a complete call."""

    kind: EventKind
    text: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class ParserOptions:
    """What a parser needs to know about the request.

    ``names``: tools the model may call (None: any name; an empty set: none, all text is content).
    ``in_reasoning``: the prompt ends inside an open reasoning segment (e.g. the generation prompt
    pre-filled ``<think>\\n``), so the output starts as reasoning.
    ``schemas``: each tool's ``parameters`` (formats that write untyped values use them to type).
    ``variant``: the sub-format the generation prompt selects (:meth:`ToolFormat.variant`).
    """

    names: frozenset[str] | None = None
    in_reasoning: bool = False
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    variant: str = ""  # a sub-format the generation prompt selects (ToolFormat.variant)

    def allows(self, name: str) -> bool:
        return self.names is None or name in self.names


class OutputParser(ABC):
    """Incremental parser: ``feed(delta)`` and ``finish()`` return the events they complete."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Consume the next generated text."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """End of output: flush what was held back (an unfinished call becomes content)."""

    def parse(self, text: str) -> list[Event]:
        """The whole output at once (the non-streamed path)."""
        return merge_events(self.feed(text) + self.finish())


class SteppingParser(OutputParser):
    """A parser driven by ``_step(out, final)``, called until it returns False (nothing more it
    can decide with the text it holds in ``buf``); ``_flush(out)`` ends the output."""

    buf: str

    @abstractmethod
    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what can be decided from ``buf``; True when it should be called again."""

    def _flush(self, out: list[Event]) -> None:
        """After the last step: what is still held back (nothing by default)."""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        self._flush(out)
        return out


def merge_events(events: Iterable[Event]) -> list[Event]:
    """Adjacent content (or reasoning) events joined into one."""
    out: list[Event] = []
    for event in events:
        if out and event.kind != "call" and out[-1].kind == event.kind:
            out[-1] = Event(event.kind, out[-1].text + event.text)
        else:
            out.append(event)
    return out


class ToolFormat(ABC):
    """One family's tool-call format (see the module docstring)."""

    name: str = ""
    #: Marker strings of the family (special tokens where the tokenizer has them).
    markers: tuple[str, ...] = ()
    #: Whether the family writes reasoning segments (``<think>`` or a channel).
    has_reasoning: bool = False
    #: Text that opens a reasoning segment, to tell whether a rendered prompt ends inside one.
    reasoning_open: tuple[str, ...] = ()
    reasoning_close: tuple[str, ...] = ()

    @classmethod
    @abstractmethod
    def detect(cls, template: str, special_tokens: frozenset[str]) -> bool:
        """Whether a chat template (and tokenizer special tokens) write calls in this format."""

    @abstractmethod
    def parser(self, options: ParserOptions) -> OutputParser:
        """A fresh incremental output parser."""

    @abstractmethod
    def call_tag(self, name: str, content: dict[str, Any]) -> dict[str, Any]:
        """An xgrammar structural ``tag`` for one call of ``name``; ``content`` is the structural-tag
        content constraining its arguments (see :attr:`argument_style`)."""

    #: How arguments are written: "json" (a JSON object, constrained by a grammar in ``json.dumps``
    #: layout), an xgrammar XML style ("qwen_xml", "glm_xml": typed by the parameters schema), a
    #: notation of the family's own (:meth:`argument_grammar` writes its grammar), or "" (not
    #: constrainable: "auto" runs free, forced calls are refused).
    argument_style: str = "json"

    def argument_grammar(self, schema: dict[str, Any]) -> str | None:
        """EBNF for arguments valid against ``schema`` (rewritten into enforceable keywords), for a
        family whose notation xgrammar has no style for; None: the style is xgrammar's. Raises
        ValueError (with the reason) for a schema the notation cannot enforce."""
        return None
    #: The marker that opens a call with tool_choice "auto" (the structural tag's trigger).
    trigger: str = ""
    #: Written before a call's ``begin`` under "auto" (where the trigger is not part of the call).
    auto_prefix: str = ""
    #: Text between two calls (``tags_with_separator``).
    separator: str = ""

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (``arguments``: JSON object text), for prompts of
        templates without tool support; JSON-argument formats use their tag's begin and end."""
        tag = self.call_tag(name, {})
        return tag["begin"] + arguments + tag["end"]

    def variant(self, prompt: str) -> str:
        """The sub-format a generation prompt selects, for families with incompatible ones."""
        return ""

    def prompt_in_reasoning(self, prompt: str) -> bool:
        """Whether the rendered ``prompt`` ends inside an open reasoning segment."""
        if not self.reasoning_open:
            return False
        opened = max(prompt.rfind(m) for m in self.reasoning_open)
        closed = max(prompt.rfind(m) for m in self.reasoning_close) if self.reasoning_close else -1
        return opened >= 0 and opened > closed and not prompt[opened:].rstrip().endswith(tuple(self.reasoning_close))

    def structural_tag(self, plan: ToolPlan, content_of) -> dict[str, Any] | None:
        """The structural tag enforcing ``plan``; ``content_of(tool)`` gives the structural-tag
        content for a tool's arguments. None when nothing is enforced."""
        if plan.mode == "none":
            return None
        tags = [self.call_tag(tool.name, content_of(tool)) for tool in plan.callable_tools()]
        if plan.mode == "auto":
            tags = [{**tag, "begin": self.auto_prefix + tag["begin"]} for tag in tags]
            fmt: dict[str, Any] = {
                "type": "triggered_tags",
                "triggers": [self.trigger],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not plan.parallel,
            }
        else:
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not plan.parallel,
            }
        return {"type": "structural_tag", "format": fmt}


class _Channel:
    """Text of one kind (content or reasoning) on its way out: optionally stripped at both ends
    (leading whitespace dropped, trailing whitespace held until more text follows)."""

    def __init__(self, kind: EventKind, strip: bool) -> None:
        self.kind = kind
        self.strip = strip
        self.started = False
        self.hold = ""

    def emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if not self.strip:
            out.append(Event(self.kind, text))
            return
        if not self.started:
            text = text.lstrip()
            if not text:
                return
        pending = self.hold + text
        body = pending.rstrip()
        self.hold = pending[len(body) :]
        if body:
            self.started = True
            out.append(Event(self.kind, body))


class BlockParser(OutputParser):
    """Streaming machinery shared by the marker-based formats.

    Modes: ``content`` (free text: watch for a reasoning opener or a call opener), ``reasoning``
    (watch for a reasoning closer, and with ``calls_end_reasoning`` for a call opener) and
    ``block`` (a call block is being collected until :meth:`block_end` finds its end). Text that
    could still become a marker is held back; everything else goes out at once.
    """

    think_open: tuple[str, ...] = ()
    think_close: tuple[str, ...] = ()
    openers: tuple[str, ...] = ()
    calls_end_reasoning = False
    strip_content = True
    strip_reasoning = True
    #: Reasoning markers only count at the very start of the output (after whitespace).
    think_only_at_start = False

    def __init__(self, options: ParserOptions) -> None:
        self.options = options
        self.mode = "reasoning" if options.in_reasoning and self.think_close else "content"
        self.buf = ""
        self.opener = ""
        self.at_start = True  # nothing but whitespace seen in content mode yet
        self.content = _Channel("content", self.strip_content)
        self.reasoning = _Channel("reasoning", self.strip_reasoning)
        self.tools_enabled = options.names is None or bool(options.names)
        self.calls_made = 0

    # -- hooks -------------------------------------------------------------------------------

    def block_end(self, buf: str, final: bool) -> int | None:
        """Where the call block in ``buf`` (starting with ``self.opener``) ends, or None when not
        yet known. ``final``: no more text will come."""
        raise NotImplementedError

    def parse_block(self, block: str) -> list[tuple[str, str]] | None:
        """The calls ``(name, arguments JSON)`` in a complete block, or None (not a valid call:
        the block is kept as content)."""
        raise NotImplementedError

    def salvage(self, buf: str) -> list[tuple[str, str]]:
        """The complete calls at the start of an unfinished block (a section cut short after its
        first calls); the unfinished rest is dropped."""
        return []

    def start_opener(self, buf: str) -> str | None:
        """An opener that only counts at the start of the output (e.g. a bare JSON call): the
        opener text if ``buf`` (at output start, whitespace stripped) begins one, "" when
        ``buf`` may still grow into one, None when it does not."""
        return None

    # -- machinery ---------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._run(out, final=True)
        return out

    def _run(self, out: list[Event], final: bool) -> None:
        while True:
            step = {"content": self._content, "reasoning": self._reasoning, "block": self._block}[self.mode]
            if not step(out, final):
                return

    def _markers(self) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        if self.think_open and (not self.think_only_at_start or self.at_start):
            found += [(m, "think") for m in self.think_open]
        if self.tools_enabled:
            found += [(m, "call") for m in self.openers]
        return found

    def _content(self, out: list[Event], final: bool) -> bool:
        if self.at_start and self.tools_enabled:
            stripped = self.buf.lstrip()
            if not stripped and not final:
                return False
            opener = self.start_opener(stripped) if stripped else None
            if opener == "" and not final:
                return False
            if opener:
                self.at_start = False
                self.content.emit(self.buf[: len(self.buf) - len(stripped)], out)
                self.buf, self.opener, self.mode = stripped, opener, "block"
                return True
        hit = _earliest(self.buf, self._markers())
        if hit is None:
            keep = 0 if final else _partial_suffix(self.buf, [m for m, _ in self._markers()])
            self._text(self.content, self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        pos, marker, kind = hit
        self._text(self.content, self.buf[:pos], out)
        if kind == "think":
            self.buf, self.mode = self.buf[pos + len(marker) :], "reasoning"
        else:
            self.buf, self.opener, self.mode = self.buf[pos:], marker, "block"
        self.at_start = False
        return True

    def _text(self, channel: _Channel, text: str, out: list[Event]) -> None:
        if text.strip() or channel is not self.content:
            if channel is self.content and text.strip():
                self.at_start = False
            channel.emit(text, out)
        elif text:
            channel.emit(text, out)

    def _reasoning(self, out: list[Event], final: bool) -> bool:
        markers = [(m, "close") for m in self.think_close]
        if self.calls_end_reasoning and self.tools_enabled:
            markers += [(m, "call") for m in self.openers]
        hit = _earliest(self.buf, markers)
        if hit is None:
            keep = 0 if final else _partial_suffix(self.buf, [m for m, _ in markers])
            self.reasoning.emit(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        pos, marker, kind = hit
        self.reasoning.emit(self.buf[:pos], out)
        self.at_start = True
        if kind == "close":
            self.buf, self.mode = self.buf[pos + len(marker) :], "content"
        else:
            self.buf, self.opener, self.mode = self.buf[pos:], marker, "block"
            self.at_start = False
        return True

    def _block(self, out: list[Event], final: bool) -> bool:
        end = self.block_end(self.buf, final)
        if end is None:
            if not final:
                return False
            self._unfinished(out)
            return False
        block, self.buf = self.buf[:end], self.buf[end:]
        calls = self.parse_block(block)
        if calls is not None and not all(self.options.allows(name) for name, _ in calls):
            calls = None  # a call of a tool the request does not offer is not a call
        if calls:
            self.calls_made += len(calls)
            out.extend(Event("call", name=name, arguments=arguments) for name, arguments in calls)
        elif calls is None:
            self.content.emit(block, out)
        self.mode = "content"
        return True

    def _unfinished(self, out: list[Event]) -> None:
        """A block cut short (``max_tokens``): its complete calls are kept; the rest is dropped when
        it is empty or follows calls (a cut-off call is never reported), else kept as content."""
        calls = [c for c in self.salvage(self.buf) if self.options.allows(c[0])]
        out.extend(Event("call", name=name, arguments=arguments) for name, arguments in calls)
        self.calls_made += len(calls)
        rest = self.buf[len(self.opener) :] if self.buf.startswith(self.opener) else self.buf
        if rest.strip() and not self.calls_made:
            self.content.emit(self.buf, out)
        self.buf = ""


def _earliest(text: str, markers: list[tuple[str, str]]) -> tuple[int, str, str] | None:
    best: tuple[int, str, str] | None = None
    for marker, kind in markers:
        pos = text.find(marker)
        if pos >= 0 and (best is None or pos < best[0] or (pos == best[0] and len(marker) > len(best[1]))):
            best = (pos, marker, kind)
    return best


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


# --------------------------------------------------------------------------- JSON helpers


def json_object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object (or array) starting at ``text[start]``; None when it does
    not close within ``text``. Tracks only nesting and strings."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def loads_object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object, or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def dumps_arguments(arguments: dict[str, Any]) -> str:
    """Arguments rebuilt from parsed values, in ``json.dumps`` layout (non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def canonical_arguments(text: str) -> str | None:
    """``text`` if it is a JSON object (kept exactly as written), else None."""
    return text.strip() if loads_object(text) is not None else None


def coerce_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """An untyped parameter value (XML-style formats write them as bare text) typed by the
    parameter's schema: text for strings, JSON (or a Python literal: ``True``, ``None``) for other
    types; ``null`` becomes None only where the schema allows null."""
    types = _schema_types(schema)
    if raw.strip() in ("null", "None") and _allows_null(schema):
        return None
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and raw not in enum and raw.strip() in enum:
        return raw.strip()  # whitespace around an enum value is layout, not part of the value
    if types == {"string"}:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        value = _PY_LITERALS.get(text, raw)
        if value is raw:
            return raw
    if value is None and types and not _allows_null(schema):
        return raw
    if isinstance(value, str) or not types or "string" not in types:
        return value
    return value if not isinstance(value, (int, float)) or _numeric(types) else raw


_PY_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def _allows_null(schema: dict[str, Any] | None) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_allows_null(sub) for key in ("anyOf", "oneOf") for sub in schema.get(key, []) or [])


def _numeric(types: set[str]) -> bool:
    return bool(types & {"integer", "number"})


def _schema_types(schema: dict[str, Any] | None) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str) and k != "null"}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []) or []:
            types |= _schema_types(sub)
    return types


def param_schema(options: ParserOptions, tool: str, param: str) -> dict[str, Any] | None:
    """The schema of ``param`` in ``tool``'s parameters, if known."""
    props = options.schemas.get(tool, {}).get("properties")
    return props.get(param) if isinstance(props, dict) else None
