"""plan_tools: OpenAI validation rules and the mapping of every tool_choice form."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from server.errors import APIError
from server.tools import ToolPlan, plan_tools

from .toolcases import NOARGS, TIME, WEATHER, request


def _error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        plan_tools(request(**fields))
    assert info.value.status == 400
    return info.value


def test_no_tools_means_no_plan() -> None:
    assert plan_tools(request()) is None
    assert plan_tools(request(parallel_tool_calls=False)) is None


def test_default_choice_is_auto_and_parallel() -> None:
    plan = plan_tools(request(tools=[WEATHER, TIME]))
    assert isinstance(plan, ToolPlan)
    assert (plan.mode, plan.parallel, plan.legacy) == ("auto", True, False)
    assert [t.name for t in plan.tools] == ["get_weather", "get_time"]
    assert plan.names == {"get_weather", "get_time"}


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_string_choices(choice: str) -> None:
    plan = plan_tools(request(tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False))
    assert plan is not None and plan.mode == choice and plan.parallel is False
    assert plan.names == (set() if choice == "none" else {"get_weather"})


def test_named_choice() -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice))
    assert plan is not None and (plan.mode, plan.named) == ("named", "get_time")
    assert plan.names == {"get_time"}
    assert [t.name for t in plan.callable_tools()] == ["get_time"]


def test_missing_parameters_mean_no_arguments() -> None:
    plan = plan_tools(request(tools=[NOARGS]))
    assert plan is not None
    assert plan.tools[0].parameters == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "none"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "bogus", "function": {"name": "x"}}},
            "tool_choice.type",
        ),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "function_call"),
        ({"functions": [WEATHER["function"]], "function_call": "required"}, "function_call"),
        ({"functions": [WEATHER["function"]], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name"),
        ({"functions": [WEATHER["function"], WEATHER["function"]]}, "functions[1].name"),
        ({"tools": [{"type": "function", "function": {"name": "x", "extra": 1}}]}, "tools[0].function.extra"),
    ],
)
def test_validation_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert _error(**fields).param == param


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"type": "nonsense"}}},
        {"type": "object", "required": "a"},
        {"type": "string"},
        [1, 2],
    ],
)
def test_invalid_parameter_schemas(parameters: Any) -> None:
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    error = _error(tools=[WEATHER, TIME, bad])
    assert error.param == "tools[2].function.parameters"
    assert "bad" in error.message


def test_legacy_functions_map_onto_tools() -> None:
    functions = [copy.deepcopy(WEATHER["function"]), copy.deepcopy(TIME["function"])]
    plan = plan_tools(request(functions=functions))
    assert plan is not None and (plan.mode, plan.legacy, plan.parallel) == ("auto", True, False)
    named = plan_tools(request(functions=functions, function_call={"name": "get_time"}))
    assert named is not None and (named.mode, named.named) == ("named", "get_time")
    none = plan_tools(request(functions=functions, function_call="none"))
    assert none is not None and none.mode == "none"
