"""Turn a finished generation into ``(content, tool_calls)`` (non-streamed responses)."""

from __future__ import annotations

import json
import secrets
import string

from server.protocol import AssistantMessage, FunctionCall, ToolCall
from server.tools.format import CALL_OPEN
from server.tools.plan import ToolPlan
from server.tools.scan import ObjectScanner, Status, scan_header, scan_tail

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def parse_tool_output(text: str, plan: ToolPlan | None) -> tuple[str | None, list[ToolCall]]:
    """Split generated ``text`` into content and calls.

    A call counts only when complete: known name, arguments a JSON object, closing
    ``}</tool_call>``. Anything else (text around calls, a call cut short by ``max_tokens``, a
    malformed call) stays in the content, in order; this never raises. Content is None when calls
    were found and the remaining text is only whitespace. With no plan or mode "none" the text is
    returned untouched.
    """
    if plan is None or plan.mode == "none":
        return text, []
    segments: list[str] = []
    calls: list[ToolCall] = []
    pos = search = 0
    while (start := text.find(CALL_OPEN, search)) >= 0:
        found = _complete_call(text, start, plan.names)
        if found is None:
            search = start + 1
            continue
        name, arguments, end = found
        segments.append(text[pos:start])
        calls.append(make_call(name, arguments))
        pos = search = end
    segments.append(text[pos:])
    content = "".join(segments)
    return (None if calls and not content.strip() else content), calls


def make_call(name: str, arguments: str, call_id: str | None = None) -> ToolCall:
    """A response ``ToolCall`` (arguments kept exactly as generated)."""
    function = FunctionCall(name=name, arguments=arguments)
    return ToolCall(id=call_id or new_call_id(), type="function", function=function)


def finish_reason(plan: ToolPlan | None, has_calls: bool, default: str) -> str:
    """The finish reason: "tool_calls" (legacy: "function_call") when calls were made, else ``default``.

    "length" always stays: the output was cut by ``max_tokens`` (or the context), so the calls may
    be incomplete -- a call cut short is kept as text by the parser, and a client seeing
    "tool_calls" would take the calls as all there are.
    """
    if not has_calls or plan is None or default == "length":
        return default
    return "function_call" if plan.legacy else "tool_calls"


def assistant_message(content: str | None, calls: list[ToolCall], plan: ToolPlan | None) -> AssistantMessage:
    """The response message: ``tool_calls``, or for legacy plans ``function_call`` (first call)."""
    if not calls:
        return AssistantMessage(content=content)
    if plan is not None and plan.legacy:
        return AssistantMessage(content=content, function_call=calls[0].function)
    return AssistantMessage(content=content, tool_calls=calls)


def _complete_call(text: str, start: int, names: frozenset[str]) -> tuple[str, str, int] | None:
    header = scan_header(text, start, names)
    if header.status is not Status.DONE:
        return None
    length = ObjectScanner().feed(text[header.end :])
    if length < 0:
        return None
    arguments = text[header.end : header.end + length]
    if not _is_json_object(arguments):
        return None
    status, end = scan_tail(text, header.end + length)
    return (header.name, arguments, end) if status is Status.DONE else None


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
