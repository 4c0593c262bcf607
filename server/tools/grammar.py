"""The generation constraint for tool calls, as an xgrammar structural tag.

Each callable tool becomes one tag in the model family's format (``server.tools.formats``; in the
default ``qwen3-hermes`` one: begin = the fixed call header naming the tool, content = its
``parameters`` JSON Schema as a grammar for JSON in ``json.dumps`` layout, end = ``}</tool_call>``).
Then:

* "required" / "named": ``tags_with_separator`` (the family's separator, ``at_least_one``) --
  nothing but calls; with ``parallel=False`` also ``stop_after_first``, so exactly one call.
* "auto": ``triggered_tags`` on the family's call opener (``<tool_call>``) -- free text until the
  trigger, then a well-formed call; with ``parallel=False`` generation ends after the first call.
* "none": no constraint.

The arguments are written in one fixed layout, the one ``json.dumps`` uses (and the tool
definitions in the default prompt; also the default ``json_layout`` of structured outputs): no
whitespace but the single spaces in ``", "`` and ``": "``
(whitespace carries no meaning in JSON). A model cannot pad with whitespace, spends no tokens on
indentation (the default model's pretty-printed weather call took 41 tokens, one-line 36), and
``arguments`` come out in the same layout every time. Properties come in the schema's order and
undeclared properties are not generated (xgrammar's strict mode, as for its structural-tag JSON
content); every output still validates against the schema as given.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from server.errors import bad_request
from server.memory import DERIVED_TEXT
from server.tools.plan import ToolPlan, ToolSpec

if TYPE_CHECKING:
    from constraints import ConstraintSpec
    from server.tools.formats import ToolFormat


def tool_structural_tag(plan: ToolPlan | None) -> dict[str, Any] | None:
    """The xgrammar structural tag (``{"type": "structural_tag", "format": ...}``) enforcing the
    plan in the model family's own format (:meth:`ToolFormat.structural_tag`), or None when
    nothing is enforced."""
    if plan is None or plan.mode == "none":
        return None
    from server.tools.formats import get_format

    fmt = get_format(plan.format_name)
    if not fmt.argument_style:  # no constrainable argument notation: "auto" runs free
        _refuse_forced_calls(plan, fmt)
        return None
    return fmt.structural_tag(plan, lambda tool: _arguments_content(plan, fmt, tool))


def _refuse_forced_calls(plan: ToolPlan, fmt: ToolFormat) -> None:
    """A 400 naming ``tool_choice`` for calls forced in a family whose arguments cannot be
    constrained ("auto" passes)."""
    if plan.mode == "auto":
        return
    param = "function_call" if plan.legacy else "tool_choice"
    raise bad_request(
        f"tool_choice '{plan.mode}' cannot be enforced in the model's '{fmt.name}' tool-call format; "
        "use 'auto' (or --tool-call-format qwen3-hermes)",
        param,
        code="unsupported_value",
    )


def _arguments_content(plan: ToolPlan, fmt: ToolFormat, tool: ToolSpec) -> dict[str, Any]:
    """The structural-tag content of ``tool``'s arguments: JSON by the grammar below, the family's
    own notation by its grammar, XML-style parameters by xgrammar's matching JSON-Schema style."""
    param = _param(plan, tool)
    if fmt.argument_style == "json":
        return {"type": "grammar", "grammar": _arguments_grammar(tool, param)}
    schema = _enforceable_schema(tool, param)
    try:
        own = fmt.argument_grammar(schema)
    except ValueError as exc:
        raise bad_request(
            f"Schema for function '{tool.name}' cannot be enforced in the '{fmt.name}' tool-call format: {exc}",
            param,
            code="unsupported_constraint",
        ) from None
    if own is not None:
        return {"type": "grammar", "grammar": own}
    # bounded whitespace: the XML styles allow it between and around values, and a model
    # must not be able to spend its tokens on it
    return {"type": "json_schema", "json_schema": schema, "style": fmt.argument_style, "max_whitespace_cnt": 1}


def tool_constraint_spec(plan: ToolPlan | None) -> ConstraintSpec | None:
    """The plan's constraint as a ``constraints.ConstraintSpec`` of kind "structural_tag" (source =
    :func:`tool_structural_tag`), or None for "none" / no plan."""
    tag = tool_structural_tag(plan)
    if tag is None:
        return None
    from constraints import ConstraintSpec  # lazy: keeps this module importable on its own

    return ConstraintSpec(kind="structural_tag", source=tag)


def _param(plan: ToolPlan, tool: ToolSpec) -> str:
    """The request field holding ``tool``'s parameters schema (for error messages)."""
    index = plan.tools.index(tool)
    return f"functions[{index}].parameters" if plan.legacy else f"tools[{index}].function.parameters"


def _arguments_grammar(tool: ToolSpec, param: str) -> str:
    schema = json.dumps(_enforceable_schema(tool, param), sort_keys=False)
    try:
        return _dumps_json_ebnf(schema)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/TypeError on schemas it cannot convert
        lines = str(exc).strip().splitlines()
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__
        raise bad_request(f"Invalid schema for function '{tool.name}': cannot enforce it: {reason}", param) from None


@DERIVED_TEXT.cached
def _dumps_json_ebnf(schema: str) -> str:
    """EBNF for the JSON text of instances of ``schema`` in ``json.dumps`` layout."""
    import xgrammar as xgr  # lazy: keeps this module importable on its own

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True)
    return str(grammar)


def _enforceable_schema(tool: ToolSpec, param: str) -> dict[str, Any]:
    """The parameters schema rewritten into keywords xgrammar enforces, or a 400 naming the
    keyword and where it is: a call must never be only half-checked against its schema."""
    from constraints import ConstraintError
    from constraints.schema.analysis import check_schema, normalise_schema, rewrite_schema, xgrammar_gaps

    schema = _object_schema(tool.parameters)
    try:
        schema = normalise_schema(schema)
        check_schema(schema)
        rewritten = rewrite_schema(schema)
    except ConstraintError as exc:
        raise bad_request(f"Invalid schema for function '{tool.name}': {exc.message}", param) from None
    gaps = xgrammar_gaps(rewritten)
    if gaps:
        pointer, keyword = gaps[0]
        raise bad_request(
            f"Schema for function '{tool.name}': keyword '{keyword}' at {pointer} cannot be enforced",
            param,
            code="unsupported_constraint",
        )
    return rewritten


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments are always a JSON object: make an implicit top-level type explicit."""
    if "type" in schema:
        return schema
    return {**schema, "type": "object"}
