"""xgrammar backend: JSON schema, json_object, EBNF and structural tags (pushdown automata)."""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from ..errors import ConstraintTooLargeError, InvalidConstraintError, UnsupportedConstraintError
from ..spec import ConstraintSpec
from .base import Backend, CompiledConstraint, Matcher
from .messages import backend_message
from .vocabulary import TokenizerContext, tokenizer_info

if TYPE_CHECKING:
    import torch

MAX_WHITESPACE = 16  # per gap between JSON tokens: bounded so small models cannot pad forever
MAX_FORCED_CHARS = 1 << 20  # text one step may force: jump-forward runs in the server process


def _compiler(ctx: TokenizerContext) -> "xgr.GrammarCompiler":
    return ctx.cached("xgrammar", lambda: xgr.GrammarCompiler(tokenizer_info(ctx), max_threads=1, cache_enabled=False))


def layout_options(layout: str) -> dict[str, Any]:
    """xgrammar's JSON-schema arguments for a json_layout (see ``constraints.spec.JSON_LAYOUTS``)."""
    if layout == "flexible":
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
    separators = (",", ":") if layout == "compact" else (", ", ": ")
    return {"any_whitespace": False, "separators": separators}


# xgrammar 0.2.8 writes the item separator of untyped values ("any JSON") as ", " whatever the
# separators: the compact layout patches those rules
_ANY_ITEM_RULES = re.compile(r'^(basic_array_items\w* ::= .*|basic_object_properties\w* ::= .*)$', re.M)


# \UXXXXXXXX, not preceded by an escaped backslash
_LONG_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\U([0-9a-fA-F]{8})")
_VALUE_KEYS = frozenset({"const", "enum", "default", "examples", "example"})  # data, not schemas


def _optional_groups(regex: str) -> str:
    """``regex`` with every group made optional by ``)?`` written ``){0,1}`` instead."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            lead = 2 if regex.startswith("^]", i + 1) else 1 if regex.startswith(("]", "^"), i + 1) else 0
            out.append(regex[i:i + 1 + lead])
            i += 1 + lead
            continue
        elif c == ")" and regex.startswith("?", i + 1):
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _schema_regex(regex: str) -> str:
    return _optional_groups(_LONG_ESCAPE.sub(lambda m: f"{m.group(1)}\\u{{{int(m.group(2), 16):x}}}", regex))


def xgrammar_patterns(tree: Any) -> Any:
    """A copy of a schema (or structural tag) with its regexes spelled the way xgrammar 0.2.8's
    JSON-schema ``pattern`` reads them as written:

    * code points past U+FFFF as ``\\u{…}``: it reads ``\\U0010ffff`` as the letters
      ``U0010ffff`` (so ``[\\u0000-/:-\\U0010ffff]`` held the range ``0-U``: ``<`` got through);
    * an optional group as ``(…){0,1}``: it read ``a(?:xb*)?`` as if it were ``ax?b*`` (``ab``
      got through, and ``^(?:xb*)?$`` matched nothing at all).
    """
    if isinstance(tree, list):
        return [xgrammar_patterns(v) for v in tree]
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if key in _VALUE_KEYS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = _schema_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {_schema_regex(k): xgrammar_patterns(v) for k, v in value.items()}
        else:
            out[key] = xgrammar_patterns(value)
    return out


def json_grammar(schema: Any, layout: str) -> "xgr.Grammar | str":
    """The grammar of JSON text of ``schema``'s instances in ``layout``."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(xgrammar_patterns(schema)), **layout_options(layout),
                                           strict_mode=False)
    if layout != "compact":
        return grammar
    text = str(grammar)
    patched = _ANY_ITEM_RULES.sub(lambda m: m.group(0).replace('", "', '","'), text)
    return patched if patched != text else grammar


class XGrammarMatcher(Matcher):
    """Wraps xgr.GrammarMatcher; the bitmask row is written in place."""

    def __init__(self, ctx: TokenizerContext, compiled: "xgr.CompiledGrammar") -> None:
        self.ctx = ctx
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def accept_token(self, token_id: int) -> bool:
        if token_id < 0 or token_id >= self.ctx.tokenizer_vocab and token_id not in self.ctx.stop_token_ids:
            return False
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_bitmask_batch(
        cls, matchers: "list[XGrammarMatcher]", bitmask: "torch.Tensor", rows: list[int], threads: int
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` with xgrammar's batched fill on
        ``threads`` threads (see ``constraints.backends.batch_fill``); raises if any row fails."""
        batch, lock = _batch_matcher(threads)
        with lock:  # one fill at a time per thread pool
            batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def reset(self) -> None:
        self._m.reset()

    def forced_text(self) -> str:
        return self._m.find_jump_forward_string()


_BATCH_MATCHERS: dict[int, tuple["xgr.BatchGrammarMatcher", threading.Lock]] = {}
_BATCH_LOCK = threading.Lock()


def _batch_matcher(threads: int) -> tuple["xgr.BatchGrammarMatcher", threading.Lock]:
    """The process's BatchGrammarMatcher with ``threads`` threads (each owns a thread pool)."""
    with _BATCH_LOCK:
        entry = _BATCH_MATCHERS.get(threads)
        if entry is None:
            entry = _BATCH_MATCHERS[threads] = (xgr.BatchGrammarMatcher(threads), threading.Lock())
        return entry


class XGrammarCompiled(CompiledConstraint):
    def __init__(self, spec: ConstraintSpec, ctx: TokenizerContext, compiled: "xgr.CompiledGrammar"):
        self.spec = spec
        self.backend = "xgrammar"
        self._ctx = ctx
        self._compiled = compiled

    def new_matcher(self) -> Matcher:
        return XGrammarMatcher(self._ctx, self._compiled)

    def size_bytes(self) -> int:
        return int(self._compiled.memory_size_bytes)


class XGrammarBackend(Backend):
    """Compiles json_schema / json_object / grammar_ebnf / structural_tag / regex.

    The payload is the compiled grammar serialised to JSON; the worker first drives a matcher
    through its first step, so the server process only loads what already ran once.
    """

    name = "xgrammar"

    def __init__(self, ctx: TokenizerContext) -> None:
        super().__init__(ctx)
        _compiler(ctx)

    def compile(self, spec: ConstraintSpec, source: Any) -> str:
        comp = _compiler(self.ctx)
        try:
            compiled = self._compile(comp, spec, source)
        except (RuntimeError, ValueError, TypeError) as exc:
            msg = backend_message(str(exc)) if str(exc).strip() else type(exc).__name__
            raise InvalidConstraintError(f"xgrammar cannot compile the constraint: {msg}") from None
        _first_step(self.ctx, compiled)
        return compiled.serialize_json()

    def load(self, spec: ConstraintSpec, payload: str) -> CompiledConstraint:
        compiled = xgr.CompiledGrammar.deserialize_json(payload, tokenizer_info(self.ctx))
        return XGrammarCompiled(spec, self.ctx, compiled)

    def _compile(self, comp: "xgr.GrammarCompiler", spec: ConstraintSpec, source: Any):
        kind = spec.kind
        if kind in ("json_schema", "json_object"):
            if spec.options.get("whitespace_pattern"):
                raise UnsupportedConstraintError("xgrammar does not support whitespace_pattern")
            schema = source if kind == "json_schema" else {"type": "object"}
            return comp.compile_grammar(json_grammar(schema, spec.json_layout))
        if kind == "grammar_ebnf":
            return comp.compile_grammar(source)
        if kind == "regex":
            return comp.compile_regex(source)
        if kind == "structural_tag":
            return self._structural_tag(comp, source)
        raise UnsupportedConstraintError(f"xgrammar does not handle {kind}")

    @staticmethod
    def _structural_tag(comp: "xgr.GrammarCompiler", tag: dict):
        tag = xgrammar_patterns(tag)
        if "format" in tag:
            body = dict(tag)
            body["type"] = "structural_tag"
            return comp.compile_structural_tag(json.dumps(body))
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in tag.get("structures", [])
        ]
        return comp.compile_structural_tag(tags, list(tag.get("triggers", [])))


def _first_step(ctx: TokenizerContext, compiled: "xgr.CompiledGrammar") -> None:
    """Mask and jump-forward text of the initial state (the allocator stops runaway ones)."""
    matcher = xgr.GrammarMatcher(compiled)
    matcher.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, ctx.vocab_size))
    if len(matcher.find_jump_forward_string()) > MAX_FORCED_CHARS:
        raise ConstraintTooLargeError(f"the constraint forces more than {MAX_FORCED_CHARS} characters")
