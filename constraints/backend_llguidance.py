"""llguidance backend: JSON schema (rejects what it cannot enforce), Lark grammars, regex."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from .backend import Backend, CompiledConstraint, Matcher, TokenizerContext
from .errors import ConstraintTooLargeError, InvalidConstraintError, UnsupportedConstraintError
from .spec import ConstraintSpec

if TYPE_CHECKING:
    import torch

BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_FORMAT = re.compile(r"Unknown format: (\S+)")


def _tokenizer(ctx: TokenizerContext) -> "llguidance.LLTokenizer":
    tok = ctx.cache.get("llguidance")
    if tok is None:
        tok = llguidance.hf.from_tokenizer(
            ctx.tokenizer, n_vocab=ctx.vocab_size, eos_token=list(ctx.stop_token_ids)
        )
        ctx.cache["llguidance"] = tok
    return tok


class LLGuidanceMatcher(Matcher):
    """Wraps llguidance.LLMatcher; tokens are validated before consuming (no error state)."""

    def __init__(self, ctx: TokenizerContext, matcher: "llguidance.LLMatcher") -> None:
        self.ctx = ctx
        self._m = matcher
        self._stops = frozenset(ctx.stop_token_ids)
        self._history: list[tuple[int, bool]] = []  # (token, consumed by llguidance)

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or not 0 <= token_id < self.ctx.vocab_size:
            return False
        if token_id in self._stops and self._m.is_stopped() and not self._m.is_error():
            # llguidance stops by itself once nothing can follow; the stop token is then ours
            self._history.append((token_id, False))
            return True
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._history.append((token_id, True))
        return True

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undone = self._history[-n:]
        del self._history[-n:]
        consumed = sum(1 for _, c in undone if c)
        if consumed:
            self._m.rollback(consumed)

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1][0] in self._stops

    def reset(self) -> None:
        self._m.reset()
        self._history.clear()

    def forced_text(self) -> str:
        raw = self._m.compute_ff_bytes()
        return raw.decode("utf-8", errors="ignore") if raw else ""


class LLGuidanceCompiled(CompiledConstraint):
    def __init__(self, spec: ConstraintSpec, ctx: TokenizerContext, grammar: str) -> None:
        self.spec = spec
        self.backend = "llguidance"
        self._ctx = ctx
        self._grammar = grammar
        # parsing the grammar costs ms; copies of a pristine matcher cost µs
        self._template = llguidance.LLMatcher(_tokenizer(ctx), grammar, log_level=0)

    def new_matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._ctx, self._template.deep_copy())

    def size_bytes(self) -> int:
        return 64 * 1024 + 8 * len(self._grammar)


def json_options(spec: ConstraintSpec) -> dict[str, Any]:
    """llguidance JSON options from the spec: strict, bounded whitespace unless told otherwise."""
    opts: dict[str, Any] = {
        "lenient": not spec.strict,
        "coerce_one_of": False,
        "json_allow_general_unicode_escapes": True,  # json.dumps writes \u00e9 by default
    }
    if spec.options.get("whitespace_pattern"):
        opts.update(whitespace_flexible=True, whitespace_pattern=spec.options["whitespace_pattern"])
    elif spec.options.get("disable_any_whitespace"):
        opts.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
    else:
        opts.update(whitespace_flexible=True, whitespace_pattern=BOUNDED_WHITESPACE)
    return opts


class LLGuidanceBackend(Backend):
    """Compiles json_schema / json_object / grammar_lark / regex with llguidance."""

    name = "llguidance"

    def __init__(self, ctx: TokenizerContext) -> None:
        super().__init__(ctx)
        _tokenizer(ctx)

    def compile(self, spec: ConstraintSpec, source: Any) -> CompiledConstraint:
        grammar = self._grammar(spec, source)
        tok = _tokenizer(self.ctx)
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err:
            raise self._error(spec, err)
        compiled = LLGuidanceCompiled(spec, self.ctx, grammar)
        if compiled._template.is_error():
            raise self._error(spec, compiled._template.get_error())
        return compiled

    @staticmethod
    def _grammar(spec: ConstraintSpec, source: Any) -> str:
        kind = spec.kind
        if kind in ("json_schema", "json_object"):
            schema = source if kind == "json_schema" else {"type": "object"}
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), overrides=json_options(spec)
                )
            except ValueError as exc:
                raise InvalidConstraintError(f"invalid JSON schema: {exc}") from None
        if kind == "grammar_lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        raise UnsupportedConstraintError(f"llguidance does not handle {kind}")

    @staticmethod
    def _error(spec: ConstraintSpec, err: str) -> Exception:
        first = err.strip().splitlines()[0][:300]
        if m := _UNIMPLEMENTED.search(err):
            return UnsupportedConstraintError(
                f"keyword {m.group(1)!r} is not supported for enforcement", keyword=m.group(1)
            )
        if m := _FORMAT.search(err):
            return UnsupportedConstraintError(
                f"format {m.group(1)!r} is not supported for enforcement", keyword="format"
            )
        if "size" in err and ("exceeded" in err or "limit" in err):
            return ConstraintTooLargeError(f"constraint too large: {first}")
        if spec.kind in ("json_schema", "json_object"):
            return UnsupportedConstraintError(f"llguidance cannot enforce the schema: {first}")
        return InvalidConstraintError(f"invalid {spec.kind.replace('_', ' ')}: {first}")
