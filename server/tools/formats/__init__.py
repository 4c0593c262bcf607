"""Per-family tool-call formats (see :mod:`server.tools.formats.base` for the seam).

``get_format(name)`` returns a format by its name; ``detect_format(template, special_tokens)``
picks the family a chat template writes, or None when no family matches (the server then keeps
the default ``qwen3-hermes`` format and says so at start-up).
"""

from __future__ import annotations

from server.tools.formats.base import Event, OutputParser, ParserOptions, ToolFormat
from server.tools.formats.hermes import HermesFormat

_FORMATS: dict[str, type[ToolFormat]] = {}


def _register() -> None:
    from server.tools.formats import deepseek, gemma4, glm, gptoss, kimi, llama, mistral, qwen3xml

    # Order matters for detection: the most specific markers first, hermes (the most generic
    # ``<tool_call>``) last.
    for cls in (
        gptoss.GptOssFormat,
        kimi.KimiFormat,
        deepseek.DeepSeekFormat,
        gemma4.Gemma4Format,
        mistral.MistralFormat,
        glm.GlmFormat,
        qwen3xml.Qwen3XmlFormat,
        llama.LlamaFormat,
        HermesFormat,
    ):
        _FORMATS[cls.name] = cls


DEFAULT_FORMAT = "qwen3-hermes"


def format_names() -> list[str]:
    """Names accepted by ``--tool-call-format``."""
    if not _FORMATS:
        _register()
    return sorted(_FORMATS)


def get_format(name: str) -> ToolFormat:
    """The format called ``name`` (KeyError for an unknown name)."""
    if not _FORMATS:
        _register()
    return _FORMATS[name]()


def detect_format(template: str | None, special_tokens: frozenset[str] = frozenset()) -> ToolFormat | None:
    """The family whose format ``template`` writes (None: not recognised)."""
    if not _FORMATS:
        _register()
    if not template:
        return None
    for cls in _FORMATS.values():
        if cls.detect(template, special_tokens):
            return cls()
    return None


__all__ = [
    "DEFAULT_FORMAT",
    "Event",
    "OutputParser",
    "ParserOptions",
    "ToolFormat",
    "detect_format",
    "format_names",
    "get_format",
]
