"""Function calling (OpenAI ``tools`` / ``tool_choice`` and the legacy ``functions``), as pure
functions the chat handler calls in order:

1. ``plan = plan_tools(req)`` -- validate the request's tool fields (``APIError`` 400 naming the
   field); None when the request has neither ``tools`` nor ``functions``.
2. ``messages, tools = render_messages(req.messages, plan, template_supports_tools(tok, tpl))``
   -- then ``tok.apply_chat_template(messages, tools=tools, ...)``. Also for plain requests.
3. ``spec = tool_constraint_spec(plan)`` -- a ``ConstraintSpec(kind="structural_tag")`` for the
   grammar engine, or None (no plan, or mode "none").
4. Non-streamed: ``content, calls = parse_tool_output(text, plan)``; build the message with
   ``assistant_message(content, calls, plan)`` and ``finish_reason(plan, bool(calls), reason)``.
   Streamed: ``s = ToolCallStreamer(plan)``; send ``s.feed(delta)`` then ``s.finish()`` as
   ``choices[i].delta`` dicts; final reason ``finish_reason(plan, s.has_calls, reason)``.

Call format, prompt format and grammar: see ``format``, ``render`` and ``grammar``.

Model families: the model's own call format (``formats``: one ``ToolFormat`` per family, chosen by
``select`` from ``--tool-call-format`` or the chat template) constrains generation (the plan's
``format_name`` picks the structural tag) and parses the output: the chat handler uses
``output.parse_choice`` / ``output.ChoiceStreamer`` (content, reasoning_content, tool_calls).
``parse_tool_output`` / ``ToolCallStreamer`` remain the hermes-only reference used by older tests.
"""

from server.tools.format import CALL_CLOSE, CALL_OPEN, format_call
from server.tools.grammar import tool_constraint_spec, tool_structural_tag
from server.tools.parse import assistant_message, finish_reason, new_call_id, parse_tool_output
from server.tools.plan import ToolPlan, ToolSpec, plan_tools
from server.tools.render import ImageSlots, render_messages, template_supports_tools
from server.tools.stream import ToolCallStreamer

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "ImageSlots",
    "ToolCallStreamer",
    "ToolPlan",
    "ToolSpec",
    "assistant_message",
    "finish_reason",
    "format_call",
    "new_call_id",
    "parse_tool_output",
    "plan_tools",
    "render_messages",
    "template_supports_tools",
    "tool_constraint_spec",
    "tool_structural_tag",
]
