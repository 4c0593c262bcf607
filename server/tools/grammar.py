"""The generation constraint for tool calls, as an xgrammar structural tag.

Each callable tool becomes one tag: begin = the fixed call header naming the tool, content = its
``parameters`` JSON Schema, end = ``}</tool_call>``. Then:

* "required" / "named": ``tags_with_separator`` (no separator, ``at_least_one``) -- nothing but
  calls; with ``parallel=False`` also ``stop_after_first``, so exactly one call.
* "auto": ``triggered_tags`` on ``<tool_call>`` -- free text until the trigger, then a well-formed
  call; with ``parallel=False`` generation ends after the first call.
* "none": no constraint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.tools.format import ARGS_CLOSE, CALL_OPEN, CALL_SEPARATOR, call_prefix
from server.tools.plan import ToolPlan, ToolSpec

if TYPE_CHECKING:
    from constraints import ConstraintSpec

MAX_WHITESPACE = 16
"""Longest whitespace run allowed between JSON tokens of the arguments (a small model must not be
able to pad forever); whitespace inside strings is not limited."""


def tool_structural_tag(plan: ToolPlan | None) -> dict[str, Any] | None:
    """The xgrammar structural tag (``{"type": "structural_tag", "format": ...}``) enforcing the
    plan, or None when nothing is enforced."""
    if plan is None or plan.mode == "none":
        return None
    tags = [_tag(tool) for tool in plan.callable_tools()]
    if plan.mode == "auto":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [CALL_OPEN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not plan.parallel,
        }
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not plan.parallel,
        }
    return {"type": "structural_tag", "format": fmt}


def tool_constraint_spec(plan: ToolPlan | None) -> ConstraintSpec | None:
    """The plan's constraint as a ``constraints.ConstraintSpec`` of kind "structural_tag" (source =
    :func:`tool_structural_tag`), or None for "none" / no plan."""
    tag = tool_structural_tag(plan)
    if tag is None:
        return None
    from constraints import ConstraintSpec  # lazy: keeps this module importable on its own

    return ConstraintSpec(kind="structural_tag", source=tag)


def _tag(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": call_prefix(tool.name),
        "content": {
            "type": "json_schema",
            "json_schema": _object_schema(tool.parameters),
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": ARGS_CLOSE,
    }


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments are always a JSON object: make an implicit top-level type explicit."""
    if "type" in schema:
        return schema
    return {**schema, "type": "object"}
