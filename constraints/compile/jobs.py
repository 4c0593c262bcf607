"""What runs inside a compile worker process (see :mod:`constraints.compile.workers`).

``init`` builds the tokenizer tables of every backend once per worker; ``plan`` analyses a spec
(schema checks and rewrites, emptiness checks) into backend attempts; ``attempt`` compiles one
of them into the payload its backend loads in the server process.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..backends.base import Backend
from ..backends.registry import make_backend
from ..backends.vocabulary import TokenizerContext
from ..spec import ConstraintSpec
from . import planner
from .planner import Attempt, Plan

BACKENDS = ("xgrammar", "llguidance", "outlines")

_backends: dict[str, Backend] = {}


def init(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], fingerprint: str) -> None:
    """Build the worker's tokenizer context and every backend's tables."""
    ctx = TokenizerContext(
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        tokenizer_vocab=min(len(tokenizer), vocab_size),
        stop_token_ids=tuple(stop_token_ids),
        fingerprint=fingerprint,
    )
    for name in BACKENDS:
        backend = make_backend(name, ctx)
        backend.prepare()
        _backends[name] = backend


def plan(spec: ConstraintSpec) -> Plan:
    """The ordered backend attempts for ``spec`` (raises ConstraintError for bad specs)."""
    return planner.plan(spec)


def attempt(spec: ConstraintSpec, step: Attempt) -> Any:
    """The payload of ``step``'s backend for ``spec``."""
    return _backends[step.backend].compile(spec, step.source)
