"""Which backends to try, in which order, with which (rewritten) source, for one spec."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ConstraintError, InvalidConstraintError, UnsupportedConstraintError
from .spec import ConstraintSpec


@dataclass(frozen=True)
class Attempt:
    backend: str
    source: Any
    final_on_invalid: bool = True  # an InvalidConstraintError ends the plan (the input is bad)


class Plan(list):
    """Attempts in order, plus how to report when all of them fail."""

    def __init__(self, attempts: list[Attempt], schema: Any = None) -> None:
        super().__init__(attempts)
        self.schema = schema

    def failure(self, errors: list[ConstraintError]) -> ConstraintError:
        if not errors:
            return UnsupportedConstraintError("no backend can enforce this constraint")
        first = errors[0]
        if first.keyword and self.schema is not None and first.pointer is None:
            from .schema_analysis import find_keyword

            pointer = find_keyword(self.schema, first.keyword) or "/"
            return type(first)(
                f"keyword {first.keyword!r} at {pointer} is not supported for enforcement",
                pointer=pointer,
                keyword=first.keyword,
            )
        return first


def _strip_anchors(regex: str) -> str:
    # the whole output must match; explicit anchors are redundant and some engines reject them
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and not re.search(r"(?<!\\)(\\\\)*\\\$$", regex):
        regex = regex[:-1]
    return regex


def plan(spec: ConstraintSpec) -> Plan:
    """The ordered backend attempts for ``spec`` (analysis and rewriting happen here)."""
    forced = spec.backend if spec.backend != "auto" else None
    kind = spec.kind
    if kind == "json_schema":
        return _json_plan(spec, forced)
    if kind == "json_object":
        return Plan(_only(forced, [Attempt("xgrammar", None), Attempt("llguidance", None)]))
    if kind == "regex":
        regex = _strip_anchors(spec.source)
        if not regex:
            raise InvalidConstraintError("the regex is empty")
        return Plan(_only(forced, [
            Attempt("outlines", regex, final_on_invalid=False),
            Attempt("llguidance", regex),
            Attempt("xgrammar", regex),
        ]))
    if kind == "choice":
        from .backend_outlines import choice_regex

        return Plan(_only(forced, [
            Attempt("outlines", list(spec.source), final_on_invalid=False),
            Attempt("llguidance", choice_regex(spec.source)),
        ]))
    if kind == "grammar_ebnf":
        return Plan(_only(forced, [Attempt("xgrammar", spec.source)]))
    if kind == "grammar_lark":
        return Plan(_only(forced, [Attempt("llguidance", spec.source)]))
    if kind == "structural_tag":
        return Plan(_only(forced, [Attempt("xgrammar", spec.source)]))
    raise UnsupportedConstraintError(f"unsupported constraint kind {kind!r}")


def _only(forced: str | None, attempts: list[Attempt]) -> list[Attempt]:
    if forced is None:
        return attempts
    chosen = [a for a in attempts if a.backend == forced]
    if not chosen:
        raise UnsupportedConstraintError(f"backend {forced!r} does not support this constraint kind")
    return chosen


def _json_plan(spec: ConstraintSpec, forced: str | None) -> Plan:
    from .schema_analysis import check_schema, rewrite_schema, xgrammar_gaps

    schema = spec.source
    check_schema(schema)
    if not spec.strict:  # best effort: whatever compiles, fastest first
        return Plan(_only(forced, [Attempt("xgrammar", schema), Attempt("llguidance", schema)]), schema)
    rewritten = rewrite_schema(schema)
    attempts = [Attempt("llguidance", rewritten)]
    gaps = xgrammar_gaps(rewritten)
    if not gaps:
        attempts.append(Attempt("xgrammar", rewritten))
    elif forced == "xgrammar":
        pointer, keyword = gaps[0]
        raise UnsupportedConstraintError(
            f"keyword {keyword!r} at {pointer} is not supported for enforcement by xgrammar",
            pointer=pointer,
            keyword=keyword,
        )
    return Plan(_only(forced, attempts), rewritten)
