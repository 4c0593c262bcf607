"""Structured-output requests: pick the constraint a request asks for and compile it off the loop."""

from __future__ import annotations

from typing import Any

from server.state import ServerState


def constraint_spec(wire: dict[str, Any], tool_plan) -> Any:
    """The request's ``ConstraintSpec`` (structured-output fields or forced tool calls), or None."""
    from constraints import spec_from_request

    from server import tools as tool_calls

    spec = spec_from_request(wire)
    tool_spec = tool_calls.tool_constraint_spec(tool_plan) if tool_plan is not None else None
    if spec is not None and tool_spec is not None:
        from server.errors import bad_request

        raise bad_request(
            "a structured-output constraint cannot be combined with tool_choice that forces a call",
            param="tool_choice",
        )
    return spec or tool_spec


async def compile_constraint(state: ServerState, spec) -> Any:
    """Compile on the compiler's worker pool; ``ConstraintError`` propagates as a 400."""
    if spec is None:
        return None
    return await state.compiler.compile_async(spec)
