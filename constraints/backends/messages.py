"""A backend library's error text, as a client may read it.

xgrammar prefixes its errors with a log timestamp and the C++ source line that raised them
(``[12:30:27] /project/cpp/regex_converter.cc:83: Regex parsing error at position 3: …``);
llguidance spreads a regex error over lines (``regex parse error:``, the regex, carets under the
culprit, ``error: unclosed group``). :func:`backend_message` keeps one line that says what is
wrong and where, and no source path.
"""

from __future__ import annotations

import re

_LOG_PREFIX = re.compile(r"^\s*\[[0-9:.\s]+\]\s*")
_SOURCE = re.compile(r"(?:[\w.+-]*/)*[\w.+-]+\.(?:cc|cpp|cxx|c|h|hpp|rs)(?::\d+)+:?\s*")
_REGEX_ERROR = "regex parse error:"


def backend_message(text: str) -> str:
    """The first line of a backend error without timestamps and source paths; an llguidance
    regex error becomes ``regex parse error at position N: <what>`` (N counts characters of the
    regex as the backend got it)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    first = _SOURCE.sub("", _LOG_PREFIX.sub("", lines[0])).strip()
    if first.endswith(_REGEX_ERROR):
        first = first[:-len(_REGEX_ERROR)] + _regex_error(lines[1:])
    return first or "unknown error"


def _regex_error(rest: list[str]) -> str:
    """``regex parse error at position N: what`` from the lines after llguidance's first."""
    what = next((line.strip()[len("error:"):].strip() for line in rest if line.strip().startswith("error:")), "")
    where = ""
    if len(rest) >= 2 and rest[1].strip() and set(rest[1].strip()) <= {"^"}:
        indent = len(rest[0]) - len(rest[0].lstrip())
        where = f" at position {len(rest[1]) - len(rest[1].lstrip()) - indent}"
    return f"regex parse error{where}: {what or 'invalid syntax'}"
