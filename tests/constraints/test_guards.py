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
    bad = ConstraintSpec("json_schema", {"type": "array", "contains": {"type": "integer"}})
    with pytest.raises(ConstraintError):
        compiler.compile(bad)
    hits = compiler.cache_stats()["hits"]
    with pytest.raises(ConstraintError):
        compiler.compile(bad)
    assert compiler.cache_stats()["hits"] == hits + 1
    assert len(compiler.fingerprint) >= 16


def test_cache_bounded(tok):
    c = ConstraintCompiler(tok, 49152, max_cache_bytes=200_000)
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
