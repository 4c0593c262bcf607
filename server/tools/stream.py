"""Incremental tool-call extraction for streamed responses (OpenAI chat delta dicts)."""

from __future__ import annotations

from typing import Any

from server.tools.format import CALL_OPEN
from server.tools.parse import new_call_id
from server.tools.plan import ToolPlan
from server.tools.scan import ObjectScanner, Status, scan_header, scan_tail, trigger_hold

Delta = dict[str, Any]


class ToolCallStreamer:
    """Turn generated text deltas into OpenAI ``choices[].delta`` dicts.

    Text outside calls becomes ``{"content": ...}`` (text that may be the start of
    ``<tool_call>`` is held back, and so is whitespace-only text until it is known to be part of
    the content). A call becomes ``{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}`` once its header names a known tool, then
    ``{"tool_calls": [{"index", "function": {"arguments": fragment}}]}`` as the arguments arrive.
    Legacy plans use ``{"function_call": {...}}`` instead. Concatenated, the deltas equal
    :func:`parse_tool_output` on the whole text for every complete output. A call that is cut off
    (``max_tokens``) or malformed after its header was streamed stays a call here, while the
    non-streamed parser would have kept it as text.
    """

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self._names = plan.names if plan is not None else frozenset()
        self._legacy = bool(plan and plan.legacy)
        self._state = "text"
        self._buf = ""
        self._ws_hold = ""
        self._content_sent = False
        self._scanner = ObjectScanner()
        self.call_count = 0

    @property
    def has_calls(self) -> bool:
        """Whether at least one call was started (finish_reason "tool_calls")."""
        return self.call_count > 0

    def feed(self, text: str) -> list[Delta]:
        """Consume the next generated text; return the deltas it completes."""
        if not self._names:
            return [{"content": text}] if text else []
        self._buf += text
        out: list[Delta] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[Delta]:
        """End of generation: flush everything held back."""
        out: list[Delta] = []
        if self._names:
            self._run(out, final=True)
        if self._ws_hold and (not self.has_calls or self._content_sent):
            out.append({"content": self._ws_hold})
        self._ws_hold = ""
        return out

    def _run(self, out: list[Delta], final: bool) -> None:
        step = {
            "text": self._step_text,
            "header": self._step_header,
            "args": self._step_args,
            "tail": self._step_tail,
        }
        while step[self._state](out, final):
            pass

    def _step_text(self, out: list[Delta], final: bool) -> bool:
        start = self._buf.find(CALL_OPEN)
        if start >= 0:
            self._text(self._buf[:start], out)
            self._buf, self._state = self._buf[start:], "header"
            return True
        keep = 0 if final else trigger_hold(self._buf)
        self._text(self._buf[: len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _step_header(self, out: list[Delta], final: bool) -> bool:
        header = scan_header(self._buf, 0, self._names)
        if header.status is Status.PARTIAL and not final:
            return False
        if header.status is not Status.DONE:  # not a call: its first character is plain text
            self._text(self._buf[0], out)
            self._buf, self._state = self._buf[1:], "text"
            return True
        out.append(self._call_start(header.name))
        self._buf, self._state = self._buf[header.end :], "args"
        self._scanner = ObjectScanner()
        return True

    def _step_args(self, out: list[Delta], final: bool) -> bool:
        end = self._scanner.feed(self._buf)
        piece = self._buf if end < 0 else self._buf[:end]
        if piece:
            out.append(self._arguments(piece))
        self._buf = "" if end < 0 else self._buf[end:]
        if end >= 0:
            self._state = "tail"
        return end >= 0

    def _step_tail(self, out: list[Delta], final: bool) -> bool:
        status, end = scan_tail(self._buf, 0)
        if status is Status.PARTIAL and not final:
            return False
        if status is Status.DONE:
            self._buf = self._buf[end:]
        self._state = "text"
        return True

    def _text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        pending = self._ws_hold + text
        if not pending.strip():
            self._ws_hold = pending
            return
        self._ws_hold = ""
        self._content_sent = True
        out.append({"content": pending})

    def _call_start(self, name: str) -> Delta:
        self.call_count += 1
        if self._legacy:
            return {"function_call": {"name": name, "arguments": ""}}
        call = {
            "index": self.call_count - 1,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return {"tool_calls": [call]}

    def _arguments(self, piece: str) -> Delta:
        if self._legacy:
            return {"function_call": {"arguments": piece}}
        return {"tool_calls": [{"index": self.call_count - 1, "function": {"arguments": piece}}]}
