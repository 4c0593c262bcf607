"""Which backends to try, in which order, with which (rewritten) source, for one spec.

Planning runs in a compile worker (see :mod:`constraints.compile.jobs`): the analyses here (schema
rewriting, emptiness of regexes and grammars) may be costly for hostile inputs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from ..backends.outlines import choice_regex
from ..errors import ConstraintError, EmptyLanguageError, InvalidConstraintError, UnsupportedConstraintError
from ..regex.analysis import check_regex_nonempty, has_anchors
from ..regex.dialect import ecma_lark
from ..regex.frontend import check_lark_terminals, full_regex
from ..schema.analysis import (before_draft_06, check_refs, check_schema, find_keyword, normalise_schema,
                               open_property_count, rewrite_schema, xgrammar_gaps)
from ..schema.intersection import distribute_siblings, precompute_intersections
from ..schema.lark import LarkSchema, needs_lark
from ..schema.number_sets import numbers_only
from ..schema.numbers import decimal_spellings
from ..schema.property_order import any_order
from ..schema.runtime_checks import split_runtime_checks
from ..schema.string_sets import strings_only
from ..spec import ConstraintSpec
from .grammar_analysis import check_ebnf_productive, check_lark_productive, check_schema_productive


# why a keyword left after the schema rewrites cannot be enforced exactly
LIMIT_REASONS = {
    "oneOf": ": its branches could not be proven mutually exclusive, and oneOf is enforced only as"
             " anyOf over exclusive branches or over branches whose negations have an exact form",
    "not": ": the negated schema has no exact enforceable complement",
    "minProperties": ": property counts are enforced only over objects whose properties are all"
                     " listed (additionalProperties: false) and all required, or few enough to enumerate",
    "maxProperties": ": property counts are enforced only over objects whose properties are all"
                     " listed (additionalProperties: false) and all required, or few enough to enumerate",
    "contains": ": contains is enforced on arrays reached from the root through $ref, allOf, anyOf,"
                " items and object properties (as a grammar), with maxContains when its schema has an exact complement,"
                " and elsewhere on arrays of at most 5 items whose contains schema has one",
    "maxContains": ": on arrays longer than 5 items, the items that do not match contains must be told"
                   " apart, which needs an exact complement of the contains schema",
    "uniqueItems": ": uniqueItems is enforced only over small finite item domains (enum, const, boolean)",
}


@dataclass(frozen=True)
class Attempt:
    backend: str
    source: Any
    final_on_invalid: bool = True  # an InvalidConstraintError ends the plan (the input is bad)
    # builds no DFA of the regex, so it copes where a DFA explodes: tried next when one did
    avoids_dfa: bool = False
    checks: tuple = ()  # run-time checks its matchers add (constraints.schema.runtime_checks)


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
            pointer = find_keyword(self.schema, first.keyword) or "/"
            return type(first)(
                f"keyword {first.keyword!r} at {pointer} is not supported for enforcement"
                f"{LIMIT_REASONS.get(first.keyword, '')}",
                pointer=pointer,
                keyword=first.keyword,
            )
        return first

    def after_blowup(self, index: int) -> None:
        """Attempt ``index`` ran out of time, memory or size building a DFA: the attempts
        after it that build none go first (llguidance's lazy DFA would meet the same wall
        during generation)."""
        rest = sorted(self[index + 1:], key=lambda a: not a.avoids_dfa)
        self[index + 1:] = rest


# xgrammar parses these differently from the regex flavour requests use: never give it them
# (POSIX classes, and \A \z \Z, which it reads as literals)
_XGRAMMAR_UNSAFE_REGEX = re.compile(r"\[:|\\[AzZ]")


def _xgrammar_regex_safe(regex: str) -> bool:
    return not _XGRAMMAR_UNSAFE_REGEX.search(regex) and not has_anchors(regex)


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
        return Plan(_only(forced, _regex_attempts(full_regex(spec.source), forced)))
    if kind == "choice":
        return Plan(_only(forced, [
            Attempt("outlines", list(spec.source), final_on_invalid=False),
            Attempt("llguidance", choice_regex(spec.source)),
        ]))
    if kind == "grammar_ebnf":
        check_ebnf_productive(spec.source)
        return Plan(_only(forced, [Attempt("xgrammar", spec.source)]))
    if kind == "grammar_lark":
        check_lark_productive(spec.source)
        check_lark_terminals(spec.source)
        return Plan(_only(forced, [Attempt("llguidance", ecma_lark(spec.source))]))
    if kind == "structural_tag":
        _check_tag_schemas(spec.source)
        return Plan(_only(forced, [Attempt("xgrammar", ecma_structural_tag(spec.source))]))
    raise UnsupportedConstraintError(f"unsupported constraint kind {kind!r}")


def _regex_attempts(source: str, forced: str | None) -> list[Attempt]:
    regex = _strip_anchors(source)
    if not regex:
        raise InvalidConstraintError("the regex is empty")
    check_regex_nonempty(source)
    attempts = [Attempt("outlines", regex, final_on_invalid=False), Attempt("llguidance", regex)]
    if _xgrammar_regex_safe(regex):
        attempts.append(Attempt("xgrammar", regex, avoids_dfa=True))
    elif forced == "xgrammar":
        raise UnsupportedConstraintError(
            "xgrammar does not enforce this regex as written (inner anchors, \\A, \\z or POSIX classes)"
        )
    return attempts


def _check_tag_schemas(tag: Any) -> None:
    """$ref checks for the JSON schemas inside a structural tag (xgrammar would take a remote
    $ref as "any value")."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("schema", "json_schema") and isinstance(value, dict):
                    check_refs(value)
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def ecma_structural_tag(tag: Any) -> Any:
    """A copy of a structural tag whose JSON schemas and regex contents read as ECMA-262 (through
    the regex front end, :mod:`constraints.regex.frontend`)."""
    out = json.loads(json.dumps(tag))
    stack = [out]
    while stack:  # iterative: a tag may nest hundreds of levels
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in list(items):
            if key in ("schema", "json_schema") and isinstance(value, dict):
                node[key] = normalise_schema(value)
            elif key == "pattern" and node.get("type") == "regex" and isinstance(value, str):
                node[key] = full_regex(value, "structural tag regex")
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return out


def _only(forced: str | None, attempts: list[Attempt]) -> list[Attempt]:
    if forced is None:
        return attempts
    chosen = [a for a in attempts if a.backend == forced]
    if not chosen:
        raise UnsupportedConstraintError(f"backend {forced!r} does not support this constraint kind")
    return chosen


def _numbers_solved(schema: Any) -> Any:
    """A schema of numbers alone that negates (``not`` over ``multipleOf``, ...) as the plain
    pieces of its set (:mod:`constraints.schema.number_sets`); any other schema as it is."""
    solved = numbers_only(schema)
    if solved is False:
        raise EmptyLanguageError("no number satisfies the schema")
    return schema if solved is None else solved


def _strings_solved(schema: Any) -> Any:
    """A schema of strings alone that negates or intersects patterns as one pattern
    (:mod:`constraints.schema.string_sets`); any other schema as it is."""
    solved = strings_only(schema)
    if solved is False:
        raise EmptyLanguageError("no string satisfies the schema")
    return schema if solved is None else solved


def _json_plan(spec: ConstraintSpec, forced: str | None) -> Plan:
    schema = normalise_schema(spec.source)
    check_schema(schema)
    schema = _strings_solved(_numbers_solved(schema))
    check_schema_productive(schema)
    if not spec.strict:  # best effort: whatever compiles, fastest first
        return Plan(_only(forced, [Attempt("xgrammar", schema), Attempt("llguidance", schema)]), schema)
    order = spec.options.get("json_property_order", "auto")
    free_order = order == "any"  # larger objects too, by run-time checks
    base = rewrite_schema(schema)
    rewritten, checks = split_runtime_checks(base, free_order=free_order, free_small=order == "auto")
    if (pointer := open_property_count(rewritten)) is not None:
        raise UnsupportedConstraintError(
            f"keyword 'minProperties' at {pointer} is not supported for enforcement{LIMIT_REASONS['minProperties']}",
            pointer=pointer,
            keyword="minProperties",
        )
    # llguidance takes small objects' properties in any order (unless "declared" is asked for);
    # xgrammar keeps the declared order (an anyOf of objects costs it seconds to compile);
    # refusals name the keyword where the client wrote it (pointers of ``rewritten``)
    intersected = decimal_spellings(precompute_intersections(rewritten))
    ordered = any_order(intersected) if order != "declared" else intersected
    attempts = [Attempt("llguidance", ordered)]
    if ordered is not intersected:  # the orders' copies can be too many for llguidance: fewer spellings
        attempts.append(Attempt("llguidance", intersected))
    distributed = distribute_siblings(intersected)
    if distributed is not None:  # a recursion re-entering keywords beside allOf / anyOf: intersected here
        attempts.append(Attempt("llguidance", distributed))
    if checks:
        attempts = [dataclasses.replace(a, checks=checks) for a in attempts]
    # xgrammar and the Lark form take no patternProperties: they keep the declared order
    declared, declared_checks = rewritten, checks
    if any(c.free_keys is not None for c in checks):
        declared, declared_checks = split_runtime_checks(base, free_order=False)
    if needs_lark(rewritten):  # llguidance's JSON compiler refuses contains: as a Lark grammar
        if before_draft_06(rewritten) and not needs_lark(schema):
            attempts = []  # ... or skips it in draft 3 / 4, where the rewrite's contains is no keyword
        attempts.insert(0, Attempt("llguidance", LarkSchema(declared), checks=declared_checks))
    gaps = xgrammar_gaps(declared)
    if not gaps:
        attempts.append(Attempt("xgrammar", declared, checks=declared_checks))
    elif forced == "xgrammar":
        pointer, keyword = gaps[0]
        raise UnsupportedConstraintError(
            f"keyword {keyword!r} at {pointer} is not supported for enforcement by xgrammar",
            pointer=pointer,
            keyword=keyword,
        )
    return Plan(_only(forced, attempts), rewritten)
