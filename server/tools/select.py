"""Which tool-call format the served model writes: ``--tool-call-format`` when given, else the
family its chat template (and special tokens) show, else the default ``qwen3-hermes``."""

from __future__ import annotations

import logging
from typing import Any

from server.render import template_source
from server.tools.formats import DEFAULT_FORMAT, ToolFormat, detect_format, get_format

log = logging.getLogger("trellis.tools")


def special_tokens(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's special/added token strings."""
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    if callable(added):
        tokens |= set(added())
    return frozenset(tokens)


def choose_format(override: str, tokenizer: Any) -> tuple[ToolFormat, str]:
    """The format and how it was chosen ("flag", "detected" or "default")."""
    if override:
        return get_format(override), "flag"
    found = detect_format(template_source(tokenizer, None), special_tokens(tokenizer))
    if found is not None:
        return found, "detected"
    return get_format(DEFAULT_FORMAT), "default"


def server_format(state: Any) -> tuple[ToolFormat, str]:
    """The served model's format (chosen once, cached on the state)."""
    cached = getattr(state, "_tool_format", None)
    if cached is None:
        cached = choose_format(getattr(state.settings, "tool_call_format", "") or "", state.tokenizer)
        state._tool_format = cached
    return cached


def log_format(state: Any) -> None:
    """Say at start-up which format tool calls are read in."""
    fmt, how = server_format(state)
    if how == "default":
        log.info("tool calls: the chat template's format is not recognised; using '%s' (--tool-call-format overrides)", fmt.name)
    else:
        log.info("tool calls: format '%s' (%s)", fmt.name, "from --tool-call-format" if how == "flag" else "detected from the chat template")


def markers_are_special(state: Any, fmt: ToolFormat) -> bool:
    """Whether some of the format's markers are special tokens of the served tokenizer: then the
    output must be decoded with them (``skip_special_tokens`` false), or the parser never sees
    the markers (``[TOOL_CALLS]``, ``<|python_tag|>``, ``<|channel|>``...)."""
    cache = getattr(state, "_special_markers", None)
    if cache is None:
        cache = state._special_markers = {}
    if fmt.name not in cache:
        cache[fmt.name] = bool(special_tokens(state.tokenizer) & set(fmt.markers))
    return cache[fmt.name]


def request_format(state: Any, chat_template: str | None) -> tuple[ToolFormat, bool]:
    """The format for one request and whether it came from a recognised template or the flag (a
    request's own ``chat_template`` is looked at first)."""
    fmt, how = server_format(state)
    if chat_template is not None and how != "flag":
        found = detect_format(template_source(state.tokenizer, chat_template), special_tokens(state.tokenizer))
        if found is not None:
            return found, True
    return fmt, how != "default"
