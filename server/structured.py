"""Structured-output requests: pick the constraint a request asks for and compile it off the loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from server.context import request_log
from server.state import ServerState


async def constraint_spec_async(state: ServerState, wire: dict[str, Any], tool_plan) -> Any:
    """:func:`constraint_spec` on a worker thread under the compile budget (tool schemas are
    turned into grammars while the spec is built), so the event loop never waits on it."""
    work = asyncio.to_thread(constraint_spec, wire, tool_plan)
    try:
        return await asyncio.wait_for(work, timeout=state.settings.compile_timeout)
    except TimeoutError:
        from server.errors import APIError

        raise APIError(
            f"building the constraint exceeded the {state.settings.compile_timeout:g} s budget",
            param="tools" if tool_plan is not None else None,
            code="constraint_timeout",
        ) from None


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
    started = time.monotonic()
    try:
        return await state.compiler.compile_async(spec)
    finally:
        elapsed = time.monotonic() - started
        state.metrics.compile_seconds.labels(kind=spec.kind).observe(elapsed)
        request_log().update(constraint=spec.kind, compile_s=round(elapsed, 4))


async def apply_close_on_length(state: ServerState, wire: dict[str, Any], compiled, specs) -> None:
    """Mark the sequences' matchers for closing before their budget ends (``close_on_length``,
    the request's or the server's default); a budget below the shortest complete output is a
    400 naming the token limit, the option without a constraint a 400 naming it."""
    from constraints.spec import close_on_length_option

    from server.errors import bad_request

    asked, param = close_on_length_option(wire)
    if asked is False or (asked is None and (compiled is None or not state.settings.close_on_length)):
        return
    if compiled is None:
        raise bad_request("close_on_length needs a structured-output constraint", param=param)
    from constraints.backends.closing import MAX_COMPLETION_TOKENS

    budget = max(MAX_COMPLETION_TOKENS, *(spec.max_tokens for spec in specs))
    plan = await asyncio.to_thread(compiled.new_matcher().shortest_completion, budget)
    shortest = min((spec.max_tokens for spec in specs), default=0)
    if plan is None or len(plan) > shortest:
        need = f"more than {budget} tokens" if plan is None else f"{len(plan)} tokens"
        limit = "max_completion_tokens" if wire.get("max_completion_tokens") is not None else "max_tokens"
        raise bad_request(
            f"close_on_length: the shortest complete output found needs {need}, above {limit}={shortest}",
            param=limit,
        )
    for spec in specs:
        spec.matcher.close_on_length = True
