"""Structured-generation constraints for Trellis, independent of the server.

A request's constraint fields become a :class:`ConstraintSpec`; a :class:`ConstraintCompiler`
(one per tokenizer) compiles it, picking per request the backend that enforces all of it
(llguidance, xgrammar or outlines-core), and every sequence gets its own :class:`Matcher`::

    from constraints import ConstraintCompiler, spec_from_request

    compiler = ConstraintCompiler(tokenizer, vocab_size=49152)
    spec = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}})
    compiled = compiler.compile(spec)          # or: await compiler.compile_async(spec)
    matcher = compiled.new_matcher()
    bitmask = torch.zeros((1, (49152 + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)           # bit t%32 of word t//32 set = token t allowed
    matcher.accept_token(token_id)             # False: rejected, state unchanged

Every failure is a :class:`ConstraintError` (HTTP 400) with ``param``, ``pointer``,
``keyword`` and ``code``. Compiles run in worker processes with a time budget and a memory
cap (``compile_timeout_s``, ``compile_memory_mb``); the server process only loads their results.
"""

from .backends.base import CompiledConstraint, Matcher, TokenDFA
from .compile.compiler import ConstraintCompiler
from .errors import (
    ConstraintCrashError,
    ConstraintError,
    ConstraintMemoryError,
    ConstraintTimeoutError,
    ConstraintTooLargeError,
    EmptyLanguageError,
    InvalidConstraintError,
    UnsupportedConstraintError,
)
from .spec import KINDS, ConstraintSpec, spec_from_request

__all__ = [
    "KINDS",
    "CompiledConstraint",
    "ConstraintCompiler",
    "ConstraintCrashError",
    "ConstraintError",
    "ConstraintMemoryError",
    "ConstraintSpec",
    "ConstraintTimeoutError",
    "ConstraintTooLargeError",
    "EmptyLanguageError",
    "InvalidConstraintError",
    "Matcher",
    "TokenDFA",
    "UnsupportedConstraintError",
    "spec_from_request",
]
