"""llguidance backend: JSON schema (rejects what it cannot enforce), Lark grammars, regex."""

from __future__ import annotations

import ctypes
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from ..errors import ConstraintTooLargeError, InvalidConstraintError, UnsupportedConstraintError
from ..schema.analysis import find_keyword
from ..schema.lark import LarkSchema, lark_grammar
from ..spec import ConstraintSpec
from .base import Backend, CompiledConstraint, Matcher
from .messages import backend_message
from .vocabulary import TokenizerContext

if TYPE_CHECKING:
    import torch

BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
# llguidance's own budgets, stated so the server process's work stays bounded: grammar size
# and lexer fuel bound a matcher's construction (4M of initial fuel: large real schemas need
# 1-4M, ~2 s at most here, within the worker's compile budget), step fuel and items bound each
# token's mask
LIMITS = dict(
    max_items_in_row=10000,
    initial_lexer_fuel=4_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
)


# A sequence whose step runs out of lexer fuel (a string pattern built from nested negations can
# cost 250k in one token) is replayed once with this many times the fuel: one slow step beats a
# failed request, and the normal budget still bounds every other sequence's steps.
RESCUE_FUEL = 10


def parser_limits(rescue: bool = False) -> "llguidance.LLParserLimits":
    """The parser limits every matcher is built with (in workers and in the server); with
    ``rescue``, the larger lexer fuel a sequence is replayed with after hitting a limit."""
    if not rescue:
        return llguidance.LLParserLimits(**LIMITS)
    fuel = {k: LIMITS[k] * RESCUE_FUEL for k in ("initial_lexer_fuel", "step_lexer_fuel")}
    return llguidance.LLParserLimits(**{**LIMITS, **fuel})


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_FORMAT = re.compile(r"Unknown format: (\S+)")
# llguidance refusals that concern one keyword: the planner then names where it is
_KEYWORD_LIMITS = (
    ("oneOf constraints are not supported", "oneOf"),
    ("min/maxProperties only supported", "minProperties"),
)


def _tokenizer(ctx: TokenizerContext) -> "llguidance.LLTokenizer":
    return ctx.cached("llguidance", lambda: llguidance.hf.from_tokenizer(
        ctx.tokenizer, n_vocab=ctx.vocab_size, eos_token=list(ctx.stop_token_ids)))


class LLGuidanceMatcher(Matcher):
    """Wraps llguidance.LLMatcher; a token is taken only when the current mask allows it.

    llguidance's mask is narrower than its grammar where bytes are forced: it allows only the
    canonical tokenization of the forced text (after ``{"key":`` with the ``": "`` separator it
    allows ``Ġ"`` but not a lone ``Ġ``), while ``try_consume_tokens`` checks the grammar alone
    and takes the lone space. So ``accept_token`` also checks the mask of the current state
    (the one ``fill_bitmask`` just computed, else computed here), and the two always agree.

    When llguidance hits one of its limits mid-generation the matcher enters an error state
    in which only stop tokens are allowed; ``accept_token`` then takes a stop token too, so the
    mask and acceptance agree, and ``error`` tells what happened.
    """

    def __init__(self, ctx: TokenizerContext, matcher: "llguidance.LLMatcher", compiled: "LLGuidanceCompiled") -> None:
        self.ctx = ctx
        self._m = matcher
        self._compiled = compiled
        self._stops = frozenset(ctx.stop_token_ids)
        self._history: list[tuple[int, bool]] = []  # (token, consumed by llguidance)
        self._replayed = False
        buffer = bytearray(4 * ((ctx.vocab_size + 31) // 32))
        self._mask = memoryview(buffer).cast("i")  # int32 words, read per accepted token
        self._mask_ptr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self._mask_at: int | None = None  # len(_history) when _mask was computed; None: stale

    @property
    def error(self) -> str | None:
        """llguidance's error once a limit was hit (the output is then cut short), else None."""
        return (self._m.get_error() or "llguidance error") if self._m.is_error() else None

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or not 0 <= token_id < self.ctx.vocab_size:
            return False
        if token_id in self._stops and self._m.is_stopped():
            # llguidance stops by itself once nothing can follow (or on error); the stop token is ours
            self._history.append((token_id, False))
            return True
        if not self._mask_allows(token_id):
            return False
        was_error = self._m.is_error()
        if self._m.try_consume_tokens([token_id]) != 1:
            if was_error or not self._m.is_error():
                return False
            # a limit was hit while consuming a token the mask allowed: take it, and from now
            # on only a stop token is allowed
            self._history.append((token_id, False))
            return True
        self._history.append((token_id, True))
        return True

    def valid_prefix(self, ids) -> int:
        # drafts: llguidance checks the run without consuming it
        if self._m.is_error() or self.is_terminated() or any(t in self._stops for t in ids):
            return super().valid_prefix(ids)
        return self._m.validate_tokens(list(ids))

    def _accept_prefix(self, ids) -> int:
        # forced tokens (forced_tokens' probe, accept_forced): llguidance's grammar check of the
        # whole run at once instead of a mask per token
        if self._m.is_error() or self.is_terminated() or any(t in self._stops for t in ids):
            return super()._accept_prefix(ids)
        ids = list(ids)
        n = self._m.validate_tokens(ids)
        consumed = self._m.try_consume_tokens(ids[:n]) if n else 0
        self._history.extend((t, True) for t in ids[:consumed])
        return consumed

    def _allowed_if_only_stops(self) -> list[int]:
        # a stop token is allowed only where the output may end: everywhere else the answer is
        # [] without computing a mask (jump-forward asks after every token)
        if not (self._m.is_accepting() or self._m.is_stopped() or self._m.is_error()):
            return []
        return super()._allowed_if_only_stops()

    def _mask_allows(self, token_id: int) -> bool:
        if self._mask_at != len(self._history):
            self._update_mask()
        return bool((self._mask[token_id >> 5] >> (token_id & 31)) & 1)

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        v = bitmask[row]
        ptr, size = v.data_ptr(), v.numel() * v.element_size()
        self._update_mask(ptr, size)
        ctypes.memmove(self._mask_ptr, ptr, min(size, self._mask.nbytes))  # kept for accept_token

    @classmethod
    def fill_bitmask_batch(
        cls, matchers: "list[LLGuidanceMatcher]", bitmask: "torch.Tensor", rows: list[int], threads: int
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` with llguidance's parallel fill on
        ``threads`` threads (see ``constraints.backends.batch_fill``); raises if any row fails."""
        import torch

        # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module
        # (it sets up torch.compile at import: seconds)
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or bitmask.dim() != 2 or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous 2-D int32 CPU tensor")
        pairs = [(m._m, row) for m, row in zip(matchers, rows)]
        batch, words = bitmask.shape
        _executor(threads).unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, batch)
        for m, row in zip(matchers, rows):
            m._adopt_mask(bitmask, row)

    def _adopt_mask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Take ``bitmask[row]``, just computed for the current state by a batched fill, as
        ``fill_bitmask`` would have written it: an error state goes through ``fill_bitmask``
        (replay, stop tokens only), else the row is kept for ``accept_token``."""
        if self._m.is_error():
            self.fill_bitmask(bitmask, row)
            return
        v = bitmask[row]
        self._allow_forced_prefixes(v.data_ptr(), v.numel() * v.element_size())  # as _update_mask does
        ctypes.memmove(self._mask_ptr, v.data_ptr(), min(v.numel() * v.element_size(), self._mask.nbytes))
        self._mask_at = len(self._history)

    def _update_mask(self, ptr: int | None = None, size: int = 0) -> None:
        """Compute the current state's mask into ``ptr`` (``size`` bytes), else into ``_mask``."""
        if ptr is None:
            ptr, size = self._mask_ptr, self._mask.nbytes
        self._m.unsafe_compute_mask_ptr(ptr, size)
        if self._m.is_error() and not self._replayed:
            # copies share the lexer's caches, which other sequences may have filled up, and a
            # step may need more lexer fuel than the normal budget: replay this sequence once on
            # a fresh matcher with more fuel before giving up
            self._replayed = True
            self._m = self._replay()
            self._m.unsafe_compute_mask_ptr(ptr, size)
        if self._m.is_error():
            ctypes.memset(ptr, 0, size)
            words = (ctypes.c_int32 * (size // 4)).from_address(ptr)
            for t in self._stops:
                words[t >> 5] |= _bit(t)
        else:
            self._allow_forced_prefixes(ptr, size)
        self._mask_at = len(self._history)

    def _allow_forced_prefixes(self, ptr: int, size: int) -> None:
        """Add to the mask every token spelling a prefix of the bytes the grammar forces here.

        llguidance allows only the canonical tokenization of the forced bytes taken alone: with
        ``": "`` forced and a pattern ``^#!`` next, ``Ġ"#!`` tokenizes as ``Ġ"`` ``#!``, so
        ``Ġ"#`` is refused although ``{"p": "#!"}`` tokenizes as ``… Ġ"# !"}``. Every token
        that spells a prefix of the forced bytes is grammatical; each is checked with
        ``try_consume_tokens`` before it is allowed, so mask and acceptance still agree.
        """
        forced = self._m.compute_ff_bytes()
        if not forced:
            return
        by_bytes, longest = _token_bytes_index(self.ctx)
        words = (ctypes.c_int32 * (size // 4)).from_address(ptr)
        for end in range(1, min(len(forced), longest) + 1):
            t = by_bytes.get(forced[:end])
            if t is None or 32 * (t >> 5) >= 8 * size or words[t >> 5] & _bit(t):
                continue
            if self._m.try_consume_tokens([t]) == 1:
                self._m.rollback(1)
                words[t >> 5] |= _bit(t)
            elif self._m.is_error():
                # the probe itself hit a parser limit (a partial key can open thousands of
                # items): the token stays out and the matcher is rebuilt as it was before it
                self._m = self._rebuilt()

    def _rebuilt(self) -> "llguidance.LLMatcher":
        """A fresh matcher fed this sequence's consumed tokens (the state before a failed probe)."""
        fresh = self._compiled.fresh_matcher()
        consumed = [t for t, c in self._history if c]
        if consumed:
            fresh.try_consume_tokens(consumed)
        return fresh

    def _replay(self) -> "llguidance.LLMatcher":
        """The sequence replayed on a fresh matcher with rescue limits, the token taken when the
        limit was hit included (so the state matches what was accepted); the error state if it
        fails again."""
        fresh = self._compiled.rescue_matcher()
        taken = [t for t, c in self._history if c or t not in self._stops]
        if taken and fresh.try_consume_tokens(taken) != len(taken):
            return self._m
        self._history = [(t, c or t not in self._stops) for t, c in self._history]
        return fresh

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        undone = self._history[-n:]
        del self._history[-n:]
        if self._mask_at is not None and self._mask_at > len(self._history):
            self._mask_at = None
        consumed = sum(1 for _, c in undone if c)
        if consumed:
            self._m.rollback(consumed)

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1][0] in self._stops

    def reset(self) -> None:
        self._m.reset()
        self._history.clear()
        self._mask_at = None

    def forced_text(self) -> str:
        if self._m.is_error():
            return ""
        raw = self._m.compute_ff_bytes()
        return raw.decode("utf-8", errors="ignore") if raw else ""


def _token_bytes_index(ctx: TokenizerContext) -> tuple[dict[bytes, int], int]:
    """(bytes -> token id for the ordinary tokens, longest token in bytes), built once."""
    index = ctx.cache.get("llguidance_bytes")
    if index is None:
        tok = _tokenizer(ctx)
        special = set(getattr(ctx.tokenizer, "all_special_ids", ())) | set(ctx.stop_token_ids)
        by_bytes: dict[bytes, int] = {}
        for t in range(ctx.tokenizer_vocab):
            if t not in special:
                by_bytes.setdefault(tok.decode_bytes([t]), t)
        by_bytes.pop(b"", None)
        index = (by_bytes, max(map(len, by_bytes), default=0))
        ctx.cache["llguidance_bytes"] = index
    return index


def _bit(t: int) -> int:
    """Bit ``t % 32`` as a signed int32 value."""
    b = 1 << (t & 31)
    return b - (1 << 32) if b >= 1 << 31 else b


_EXECUTORS: dict[int, "llguidance.LLExecutor"] = {}
_EXECUTORS_LOCK = threading.Lock()


def _executor(threads: int) -> "llguidance.LLExecutor":
    """The process's LLExecutor with ``threads`` threads (each owns a thread pool)."""
    with _EXECUTORS_LOCK:
        executor = _EXECUTORS.get(threads)
        if executor is None:
            executor = _EXECUTORS[threads] = llguidance.LLExecutor(threads)
        return executor


class LLGuidanceCompiled(CompiledConstraint):
    def __init__(self, spec: ConstraintSpec, ctx: TokenizerContext, grammar: str) -> None:
        self.spec = spec
        self.backend = "llguidance"
        self._ctx = ctx
        self._grammar = grammar
        # parsing the grammar costs ms; copies of a pristine matcher cost µs
        self._template = self._build()
        self._lock = threading.Lock()

    def _build(self, rescue: bool = False) -> "llguidance.LLMatcher":
        return llguidance.LLMatcher(_tokenizer(self._ctx), self._grammar, log_level=0,
                                    limits=parser_limits(rescue))

    def new_matcher(self) -> Matcher:
        with self._lock:
            return LLGuidanceMatcher(self._ctx, self._template.deep_copy(), self)

    def fresh_matcher(self) -> "llguidance.LLMatcher":
        """A matcher from a newly built template (which later copies share)."""
        template = self._build()
        with self._lock:
            self._template = template
            return template.deep_copy()

    def rescue_matcher(self) -> "llguidance.LLMatcher":
        """A matcher of its own (not shared with later copies) with the rescue limits."""
        return self._build(rescue=True)

    def size_bytes(self) -> int:
        return 64 * 1024 + 8 * len(self._grammar)


def json_options(spec: ConstraintSpec) -> dict[str, Any]:
    """llguidance JSON options from the spec: strictness and the layout (``spec.json_layout``)."""
    opts: dict[str, Any] = {
        "lenient": not spec.strict,
        "coerce_one_of": False,
        "json_allow_general_unicode_escapes": True,  # json.dumps writes \u00e9 by default
    }
    if spec.options.get("whitespace_pattern"):
        opts.update(whitespace_flexible=True, whitespace_pattern=spec.options["whitespace_pattern"])
    elif spec.json_layout == "flexible":
        opts.update(whitespace_flexible=True, whitespace_pattern=BOUNDED_WHITESPACE)
    elif spec.json_layout == "compact":
        opts.update(whitespace_flexible=False, item_separator=",", key_separator=":")
    else:
        opts.update(whitespace_flexible=False, item_separator=", ", key_separator=": ")
    return opts


def _embed_satisfiable(schema: Any) -> bool:
    """Whether llguidance compiles ``%json schema`` to a language it does not know to be empty;
    its other errors (a keyword it does not enforce) are raised as the backend reports them."""
    err = llguidance.LLMatcher.validate_grammar(f"start: %json {json.dumps(schema)}", limits=parser_limits())
    if not err:
        return True
    if "Unsatisfiable schema" in err:
        return False
    raise LLGuidanceBackend._error(ConstraintSpec("json_schema", {}), err)


class LLGuidanceBackend(Backend):
    """Compiles json_schema / json_object / grammar_lark / regex with llguidance."""

    name = "llguidance"

    def __init__(self, ctx: TokenizerContext) -> None:
        super().__init__(ctx)
        _tokenizer(ctx)

    def compile(self, spec: ConstraintSpec, source: Any) -> str:
        """The grammar text, once a matcher was built from it and computed its first mask (the
        matcher reports what ``validate_grammar`` would, without compiling the grammar twice:
        half of a large schema's compile time)."""
        grammar = self._grammar(spec, source)
        matcher = llguidance.LLMatcher(_tokenizer(self.ctx), grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise self._error(spec, matcher.get_error())
        return grammar

    def load(self, spec: ConstraintSpec, payload: str) -> CompiledConstraint:
        compiled = LLGuidanceCompiled(spec, self.ctx, payload)
        if compiled._template.is_error():
            raise self._error(spec, compiled._template.get_error())
        return compiled

    @staticmethod
    def _grammar(spec: ConstraintSpec, source: Any) -> str:
        kind = spec.kind
        if isinstance(source, LarkSchema):
            return lark_grammar(source.schema, json_options(spec), _embed_satisfiable)
        if kind in ("json_schema", "json_object"):
            schema = source if kind == "json_schema" else {"type": "object"}
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), overrides=json_options(spec)
                )
            except ValueError as exc:
                raise InvalidConstraintError(f"invalid JSON schema: {backend_message(str(exc))}") from None
        if kind == "grammar_lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        raise UnsupportedConstraintError(f"llguidance does not handle {kind}")

    @staticmethod
    def _error(spec: ConstraintSpec, err: str) -> Exception:
        first = backend_message(err)[:300]
        if m := _UNIMPLEMENTED.search(err):
            return UnsupportedConstraintError(
                f"keyword {m.group(1)!r} is not supported for enforcement", keyword=m.group(1)
            )
        for text, keyword in _KEYWORD_LIMITS:
            if text in err:
                if keyword == "minProperties" and "minProperties" not in err and "maxProperties" in err:
                    keyword = "maxProperties"
                return UnsupportedConstraintError(
                    f"keyword {keyword!r} is not supported for enforcement", keyword=keyword
                )
        if m := _FORMAT.search(err):
            # the first use of any format could be another one, which compiled
            pointer = find_keyword(spec.source, "format", m.group(1)) if isinstance(spec.source, dict) else None
            where = f" at {pointer}" if pointer else ""
            return UnsupportedConstraintError(
                f"format {m.group(1)!r}{where} is not supported for enforcement", keyword="format", pointer=pointer
            )
        if "size" in err and ("exceeded" in err or "limit" in err):
            return ConstraintTooLargeError(f"constraint too large: {first}")
        if spec.kind in ("json_schema", "json_object"):
            return UnsupportedConstraintError(f"llguidance cannot enforce the schema: {first}")
        return InvalidConstraintError(f"invalid {spec.kind.replace('_', ' ')}: {first}")
