"""The backends by name: the one place that knows every backend (each is imported when first
asked for, so its library loads only where it is used)."""

from __future__ import annotations

from typing import Callable

from ..errors import UnsupportedConstraintError
from .base import Backend
from .vocabulary import TokenizerContext


def make_backend(name: str, ctx: TokenizerContext) -> Backend:
    """The backend called ``name`` for ``ctx``'s tokenizer."""
    if name == "xgrammar":
        from .xgrammar import XGrammarBackend

        return XGrammarBackend(ctx)
    if name == "llguidance":
        from .llguidance import LLGuidanceBackend

        return LLGuidanceBackend(ctx)
    if name == "outlines":
        from .outlines import OutlinesBackend

        return OutlinesBackend(ctx)
    raise UnsupportedConstraintError(f"unknown backend {name!r}")


BackendFactory = Callable[[TokenizerContext], Backend]
