"""The text format of function calls in model output and in the default prompt format.

One call is written as::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

Several calls (``parallel_tool_calls``) follow one another directly (``...</tool_call><tool_call>...``,
no separator): a newline after ``</tool_call>`` is what small models write on their way to ending the
turn, so with a newline separator (followed by a forced ``<tool_call>``) a greedy model would commit
to another call with its first newline and repeat calls until ``max_tokens``; without one, starting
another call (``<``) competes directly with end of turn. The header up to and including
``"arguments": `` is fixed text (names only use ``[a-zA-Z0-9_-]``, so they never need escaping);
the arguments object is JSON valid against the tool's ``parameters`` schema; the call ends with
``}</tool_call>``. Tool results are shown to the model as ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = ""
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
ARGS_CLOSE = "}" + CALL_CLOSE


def call_prefix(name: str) -> str:
    """Everything a call to ``name`` starts with, up to where its arguments object begins."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '


def format_call(name: str, arguments: str) -> str:
    """One complete call as the model writes it; ``arguments`` is the JSON object text."""
    return call_prefix(name) + arguments + ARGS_CLOSE


def format_response(content: str) -> str:
    """A tool result as shown to the model in the default prompt format."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
