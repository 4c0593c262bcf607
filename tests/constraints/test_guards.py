"""Budgets: pathological inputs answer in time, timeouts do not wedge the pool, caching."""

from __future__ import annotations

import asyncio
import time

import pytest

from constraints import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintMemoryError,
    ConstraintSpec,
    ConstraintTimeoutError,
    ConstraintTooLargeError,
    EmptyLanguageError,
    InvalidConstraintError,
    UnsupportedConstraintError,
)

from .conftest import walk_json, walk_text

BUDGET = 5.0


def _timed(compiler, spec):
    start = time.monotonic()
    try:
        result = compiler.compile(spec)
    except ConstraintError as exc:
        result = exc
    return result, time.monotonic() - start


def test_deep_nesting(compiler):
    schema: dict = {"type": "integer"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    result, took = _timed(compiler, ConstraintSpec("json_schema", schema))
    assert took < BUDGET + 1
    assert isinstance(result, ConstraintTooLargeError) and result.code == "constraint_too_large"


def test_huge_enum(compiler):
    spec = ConstraintSpec("json_schema", {"enum": [f"member-{i}" for i in range(100_000)]})
    result, took = _timed(compiler, spec)
    assert took < BUDGET + 1
    assert isinstance(result, ConstraintTooLargeError) and result.keyword == "enum"


def test_max_items_100000(compiler, tok):
    spec = ConstraintSpec("json_schema", {"type": "array", "items": {"type": "integer"}, "maxItems": 100000})
    result, took = _timed(compiler, spec)
    assert took < BUDGET + 1
    if not isinstance(result, ConstraintError):
        assert walk_json(result, tok, [1, 2, 3])


@pytest.mark.parametrize("regex", [r"(a+)+$", r"(a|aa)*c", r"(x+x+)+y", r"(a|b)*a(a|b){20}"])
def test_catastrophic_regex_within_budget(compiler, regex):
    _, took = _timed(compiler, ConstraintSpec("regex", regex))
    assert took < BUDGET + 1


def test_exploding_dfa_is_stopped_and_does_not_wedge(tok):
    c = ConstraintCompiler(tok, 49152, compile_timeout_s=1.5, max_workers=1)
    try:
        assert c.wait_ready(120)
        start = time.monotonic()
        with pytest.raises((ConstraintTimeoutError, ConstraintMemoryError)) as info:
            c.compile(ConstraintSpec("regex", r"(a|b)*a(a|b){24}", {"backend": "outlines"}))
        assert time.monotonic() - start < 1.5 + 1
        assert info.value.code in ("constraint_timeout", "constraint_memory_exceeded")
        ok = c.compile(ConstraintSpec("choice", ["x", "y"]))  # the worker was replaced
        assert ok.backend == "outlines"
    finally:
        c.close()


def test_stuck_worker_does_not_wedge(tok):
    c = ConstraintCompiler(tok, 49152, compile_timeout_s=0.5, max_workers=1)
    c.PLAN_JOB = "tests.constraints.worker_hooks:plan"
    try:
        assert c.wait_ready(120)
        with pytest.raises(ConstraintTimeoutError) as info:
            c.compile(ConstraintSpec("choice", ["sleep:30", "b"]))
        assert "0.5 s budget" in info.value.message
        assert c.wait_ready(120)
        start = time.monotonic()
        assert c.compile(ConstraintSpec("json_schema", {"type": "string"})).backend == "llguidance"
        assert time.monotonic() - start < 60  # a fresh worker may still be starting
        # the failure is cached briefly: no recompilation storm
        with pytest.raises(ConstraintTimeoutError):
            c.compile(ConstraintSpec("choice", ["sleep:30", "b"]))
    finally:
        c.close()


def test_cache_hits_and_failures(compiler):
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"cache_probe": {"type": "boolean"}}})
    before = compiler.cache_stats()
    first = compiler.compile(spec)
    again = compiler.compile(ConstraintSpec("json_schema", dict(spec.source)))
    after = compiler.cache_stats()
    assert first is again
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    assert after["entries"] >= 1 and after["bytes"] > 0
    bad = ConstraintSpec("json_schema", {"type": "array", "contains": {"type": "integer"}, "maxContains": 1})
    with pytest.raises(ConstraintError):
        compiler.compile(bad)
    hits = compiler.cache_stats()["hits"]
    with pytest.raises(ConstraintError):
        compiler.compile(bad)
    assert compiler.cache_stats()["hits"] == hits + 1
    assert len(compiler.fingerprint) >= 16


def test_cache_bounded(tok):
    c = ConstraintCompiler(tok, 49152, max_cache_bytes=200_000, max_workers=1)
    try:
        for i in range(6):
            c.compile(ConstraintSpec("json_schema", {"type": "string", "maxLength": i + 1}))
        stats = c.cache_stats()
        assert stats["bytes"] <= 200_000 and stats["entries"] < 6
    finally:
        c.close()


def test_compile_async_dedupes(compiler, tok):
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"async_probe": {"type": "integer"}}})

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.ensure_future(ticker())
        results = await asyncio.gather(*(compiler.compile_async(spec) for _ in range(5)))
        t.cancel()
        return results, ticks

    misses = compiler.cache_stats()["misses"]
    results, ticks = asyncio.run(main())
    assert all(r is results[0] for r in results)
    assert compiler.cache_stats()["misses"] == misses + 1
    assert walk_json(results[0], tok, {"async_probe": 1})


def test_async_error_has_param(compiler):
    spec = ConstraintSpec("regex", "[^\\s\\S]", param="structured_outputs.regex")

    async def main():
        return await compiler.compile_async(spec)

    with pytest.raises(ConstraintError) as info:
        asyncio.run(main())
    assert info.value.param == "structured_outputs.regex"


def test_free_text_unaffected_by_choice(compiler, tok):
    c = compiler.compile(ConstraintSpec("choice", ["alpha", "beta"]))
    assert walk_text(c, tok, "beta") and not walk_text(c, tok, "gamma")


def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_2000_levels_is_too_large_before_anything_recursive():
    from constraints import spec_from_request

    deep = _nested(2000)
    text = '{"type": "object", "properties": {"a": ' * 2000 + '{"type": "integer"}' + "}}" * 2000
    start = time.monotonic()
    with pytest.raises(ConstraintTooLargeError) as info:
        ConstraintSpec("json_schema", deep)
    assert info.value.code == "constraint_too_large"
    for body in ({"guided_json": deep}, {"guided_json": text},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}}):
        with pytest.raises(ConstraintTooLargeError) as info:
            spec_from_request(body)
        assert info.value.param
    assert time.monotonic() - start < 2


def test_text_deeper_than_the_json_parser_goes_is_too_large():
    from constraints import spec_from_request

    with pytest.raises(ConstraintTooLargeError):
        spec_from_request({"guided_json": '{"a":' * 100_000 + "1" + "}" * 100_000})


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}},
    ],
    ids=["ref_cycle", "required_cycle", "min_items_cycle"],
)
def test_schema_without_finite_value_is_refused(compiler, schema):
    start = time.monotonic()
    with pytest.raises(EmptyLanguageError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert time.monotonic() - start < 2 and info.value.code == "invalid_constraint"


def test_recursive_schema_with_a_base_case_compiles(compiler, tok):
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}, "required": ["v"]}
    assert walk_json(compiler.compile(ConstraintSpec("json_schema", schema)), tok, {"next": {"v": 2}, "v": 1})


@pytest.mark.parametrize("regex", ["a^b", r"[^\s\S]", "a$b", r"x([^\s\S])+"])
def test_regex_matching_nothing_is_refused(compiler, regex):
    with pytest.raises(EmptyLanguageError):
        compiler.compile(ConstraintSpec("regex", regex))


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec("grammar_ebnf", 'root ::= "a" root'),
        ConstraintSpec("grammar_ebnf", 'root ::= x\nx ::= "(" x ")"'),
        ConstraintSpec("grammar_lark", 'start: "a" start'),
        ConstraintSpec("grammar_lark", "start: x\nx: \"(\" x \")\"\n  | x x"),
    ],
)
def test_grammar_without_base_case_is_refused(compiler, spec):
    with pytest.raises(EmptyLanguageError):
        compiler.compile(spec)


def test_dangling_ref_names_it(compiler):
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}
    with pytest.raises(InvalidConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema, param="guided_json"))
    assert "#/$defs/nope" in info.value.message and info.value.pointer == "/properties/x/$ref"
    assert info.value.param == "guided_json"


@pytest.mark.parametrize("strict", [True, False])
def test_remote_ref_is_refused_not_accept_anything(compiler, strict):
    schema = {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}
    options = {} if strict else {"strict": False}
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema, options))
    assert "https://example.com/s.json" in info.value.message and info.value.keyword == "$ref"


def test_remote_ref_in_structural_tag_is_refused(compiler):
    tag = {"structures": [{"begin": "<f>", "schema": {"$ref": "https://example.com/s.json"}, "end": "</f>"}],
           "triggers": ["<f>"]}
    with pytest.raises(UnsupportedConstraintError):
        compiler.compile(ConstraintSpec("structural_tag", tag))


def test_local_refs_resolve(compiler, tok):
    schema = {"$defs": {"p": {"$anchor": "pt", "type": "integer"}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#pt"}}}
    assert walk_json(compiler.compile(ConstraintSpec("json_schema", schema)), tok, {"a": 1, "b": 2})
