"""System-prompt text that describes the tools to models whose template has no tool support."""

from __future__ import annotations

import json

from server.tools.format import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
from server.tools.plan import ToolPlan


def tools_system_prompt(plan: ToolPlan, write_call=None) -> str:
    """The tool definitions (one JSON object per line) and how to call them, in plain words;
    ``write_call(name, arguments)`` writes a call in the model family's format (default:
    ``<tool_call>`` JSON)."""
    definitions = "\n".join(json.dumps(t.to_openai()["function"]) for t in plan.tools)
    example = f'{CALL_OPEN}{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}{CALL_CLOSE}'
    if write_call is not None:
        example = write_call("<function name>", '{"<parameter>": "<value>"}')
    lines = [
        "# Tools",
        "",
        "You can call the functions described below (JSON, one per line) between <tools> and </tools>:",
        "<tools>",
        definitions,
        "</tools>",
        "",
        "To call a function, write its name and a JSON object of arguments that matches its "
        "parameters schema like this:",
        example,
        f"Each result comes back to you between {RESPONSE_OPEN} and {RESPONSE_CLOSE}.",
        _policy(plan, write_call),
    ]
    return "\n".join(lines)


def _policy(plan: ToolPlan, write_call=None) -> str:
    if plan.mode == "named":
        rule = f"You must call the function {plan.named}."
    elif plan.mode == "required":
        rule = "You must call at least one function."
    else:
        rule = "Call a function only when it helps; otherwise answer directly."
    if plan.parallel and write_call is not None:
        return rule + " Several calls follow one another directly."
    if plan.parallel:
        return rule + f" Several calls follow one another directly: {CALL_OPEN}...{CALL_CLOSE}{CALL_OPEN}...{CALL_CLOSE}"
    return rule + " Make at most one call per reply."
