"""Validate the tool fields of a chat request and reduce them to a :class:`ToolPlan`.

OpenAI semantics: ``tools`` + ``tool_choice`` ("none" | "auto" | "required" | named function) +
``parallel_tool_calls`` (default true). The deprecated ``functions`` + ``function_call`` ("none" |
"auto" | {"name": ...}) map onto the same plan with ``legacy=True`` (answer with
``message.function_call`` and finish_reason "function_call"; never parallel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from server.errors import APIError, bad_request
from server.protocol import ChatCompletionRequest

Mode = Literal["none", "auto", "required", "named"]

_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_TOOL_KEYS = {"type", "function"}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """One callable function: its name, description and JSON Schema for the arguments object."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The tool as an OpenAI ``{"type": "function", "function": {...}}`` dict."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What the request allows the model to do with its tools.

    ``mode``: "none" (no calls), "auto" (text or calls), "required" (one or more calls),
    "named" (calls of ``named`` only). ``parallel``: more than one call allowed. ``legacy``: the
    request used ``functions``/``function_call`` and the answer must use that shape.
    """

    mode: Mode
    tools: tuple[ToolSpec, ...]
    parallel: bool
    legacy: bool = False
    named: str | None = None
    format_name: str = "qwen3-hermes"  # the tool-call format the model writes (server.tools.formats)

    @property
    def names(self) -> frozenset[str]:
        """Names the model may call under this plan."""
        if self.mode == "none":
            return frozenset()
        if self.mode == "named":
            return frozenset({self.named or ""})
        return frozenset(tool.name for tool in self.tools)

    def callable_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the constraint allows, in request order."""
        return tuple(tool for tool in self.tools if tool.name in self.names)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """Validate ``tools``/``tool_choice``/``functions``/``function_call``; None when neither
    ``tools`` nor ``functions`` is given. Raises :class:`APIError` (400, ``param`` = the field)."""
    if req.tools is not None and req.functions is not None:
        raise bad_request("'tools' and 'functions' cannot both be given; use 'tools'", "functions")
    if req.functions is not None:
        return _legacy_plan(req)
    if req.function_call is not None:
        raise bad_request("'function_call' is only allowed when 'functions' are specified", "function_call")
    if req.tools is None:
        if req.tool_choice is not None:
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    tools = _parse_tools(req.tools)
    mode, named = _parse_choice(req.tool_choice, tools, "tool_choice", legacy=False)
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolPlan(mode=mode, tools=tools, parallel=parallel, named=named)


def _legacy_plan(req: ChatCompletionRequest) -> ToolPlan:
    if req.tool_choice is not None:
        raise bad_request("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
    functions = req.functions or []
    if not functions:
        raise bad_request("Invalid 'functions': empty array; expected at least one function", "functions")
    tools = tuple(_parse_function(f, f"functions[{i}]") for i, f in enumerate(functions))
    _check_unique(tools, "functions[{}].name")
    mode, named = _parse_choice(req.function_call, tools, "function_call", legacy=True)
    return ToolPlan(mode=mode, tools=tools, parallel=False, legacy=True, named=named)


def _parse_tools(raw: list[dict[str, Any]]) -> tuple[ToolSpec, ...]:
    if not raw:
        raise bad_request("Invalid 'tools': empty array; expected at least one tool", "tools")
    tools = tuple(_parse_tool(tool, f"tools[{i}]") for i, tool in enumerate(raw))
    _check_unique(tools, "tools[{}].function.name")
    return tools


def _parse_tool(tool: Any, param: str) -> ToolSpec:
    if not isinstance(tool, dict):
        raise bad_request(f"Invalid '{param}': expected an object", param)
    _reject_unknown(tool, _TOOL_KEYS, param)
    kind = tool.get("type")
    if kind != "function":
        raise APIError(
            f"Invalid '{param}.type': {kind!r}; only 'function' tools are supported",
            param=f"{param}.type",
            code="unsupported_value" if isinstance(kind, str) else "invalid_value",
        )
    if "function" not in tool:
        raise bad_request(f"Missing required parameter: '{param}.function'", f"{param}.function")
    return _parse_function(tool["function"], f"{param}.function")


def _parse_function(function: Any, param: str) -> ToolSpec:
    if not isinstance(function, dict):
        raise bad_request(f"Invalid '{param}': expected an object", param)
    _reject_unknown(function, _FUNCTION_KEYS, param)
    name = function.get("name")
    if name is None:
        raise bad_request(f"Missing required parameter: '{param}.name'", f"{param}.name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise bad_request(
            f"Invalid '{param}.name': {name!r} does not match '^[a-zA-Z0-9_-]{{1,64}}$'",
            f"{param}.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"Invalid '{param}.description': expected a string", f"{param}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"Invalid '{param}.strict': expected a boolean", f"{param}.strict")
    parameters = _check_parameters(function.get("parameters"), name, f"{param}.parameters")
    return ToolSpec(name=name, description=description, parameters=parameters, strict=strict)


def _check_parameters(schema: Any, name: str, param: str) -> dict[str, Any]:
    if schema is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(schema, dict):
        raise bad_request(f"Invalid schema for function '{name}': expected a JSON Schema object", param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise bad_request(f"Invalid schema for function '{name}': {exc.message}", param) from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise bad_request(
            f"Invalid schema for function '{name}': schema must be of type 'object', got {kind!r}",
            param,
        )
    return schema


def _check_unique(tools: tuple[ToolSpec, ...], param_pattern: str) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"Duplicate function name: '{tool.name}'", param_pattern.format(i))
        seen.add(tool.name)


def _reject_unknown(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in obj:
        if key not in allowed:
            raise APIError(
                f"Unknown parameter: '{param}.{key}'", param=f"{param}.{key}", code="unknown_parameter"
            )


def _parse_choice(
    choice: str | dict[str, Any] | None, tools: tuple[ToolSpec, ...], param: str, *, legacy: bool
) -> tuple[Mode, str | None]:
    if choice is None:
        return "auto", None
    allowed = ("none", "auto") if legacy else ("none", "auto", "required")
    if isinstance(choice, str):
        if choice not in allowed:
            raise bad_request(
                f"Invalid value for '{param}': {choice!r}; expected one of {', '.join(allowed)} "
                "or an object naming a function",
                param,
            )
        return choice, None  # type: ignore[return-value]
    name = _named_choice(choice, param, legacy=legacy)
    if name not in {tool.name for tool in tools}:
        raise bad_request(f"Invalid value for '{param}': no function named '{name}' was given", param)
    return "named", name


def _named_choice(choice: dict[str, Any], param: str, *, legacy: bool) -> str:
    if legacy:
        name = choice.get("name")
    else:
        if choice.get("type") != "function":
            raise bad_request(f"Invalid value for '{param}.type': expected 'function'", f"{param}.type")
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        where = f"{param}.name" if legacy else f"{param}.function.name"
        raise bad_request(f"Missing required parameter: '{where}'", where)
    return name
