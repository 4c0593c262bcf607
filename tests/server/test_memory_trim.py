"""Freed heap memory goes back to the OS once the engine idles (issue 31, "memory stays flat"), the
cache of request-derived text is bounded in bytes, and the memory bounds are flags."""

from __future__ import annotations

import argparse

import constraints
from server import state as state_module
from server.config import Settings, add_serve_arguments, settings_from_args
from server.memory import (
    DERIVED_TEXT,
    IdleTrimmer,
    TextCache,
    libc_malloc_trim,
    resident_bytes,
)

MiB = 1 << 20


class _Process:
    """A fake process: resident memory the test sets, trims that bring it back to a floor."""

    def __init__(self) -> None:
        self.rss = 1000 * MiB
        self.busy = False
        self.trims = 0

    def trim(self) -> None:
        self.trims += 1
        self.rss = 1000 * MiB


def _trimmer(process: _Process, idle_s: float = 10.0) -> IdleTrimmer:
    return IdleTrimmer(lambda: process.busy, idle_s, trim=process.trim, rss=lambda: process.rss)


def test_trims_only_after_the_idle_time_and_only_when_grown():
    process = _Process()
    trimmer = _trimmer(process)
    process.rss += 400 * MiB
    assert not trimmer.check(now=0.0) and not trimmer.check(now=9.9)
    assert trimmer.check(now=10.0) and process.trims == 1
    assert not trimmer.check(now=30.0)  # nothing grew since
    process.rss += 4 * MiB
    assert not trimmer.check(now=40.0)  # too little to be worth it


def test_busy_restarts_the_idle_clock():
    process = _Process()
    trimmer = _trimmer(process)
    process.rss += 100 * MiB
    trimmer.check(now=0.0)
    process.busy = True
    assert not trimmer.check(now=8.0)
    process.busy = False
    assert not trimmer.check(now=12.0) and not trimmer.check(now=21.0)
    assert trimmer.check(now=22.0) and process.trims == 1


def test_off_or_without_malloc_trim_it_starts_no_thread():
    process = _Process()
    for trimmer in (_trimmer(process, idle_s=0.0), IdleTrimmer(lambda: False, 10.0, trim=None)):
        trimmer.start()
        assert trimmer._thread is None
        trimmer.close()


def test_glibc_trim_runs_here():
    trim = libc_malloc_trim()
    assert trim is not None  # the servers this targets run on glibc
    trim()
    assert resident_bytes() > 0


def test_memory_flags_and_environment(monkeypatch):
    monkeypatch.setenv("TRELLIS_CONSTRAINT_DISK_CACHE_MB", "77")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--constraint-cache-mb", "12", "--memory-trim-idle", "0"]))

    assert (settings.constraint_cache_mb, settings.constraint_disk_cache_mb, settings.memory_trim_idle) == (12, 77, 0)


def test_cache_flags_reach_the_compiler(monkeypatch):
    seen = {}
    monkeypatch.setattr(constraints, "ConstraintCompiler", lambda *args, **kwargs: seen.update(kwargs))
    settings = Settings(constraint_cache_mb=12, constraint_disk_cache_mb=34, constraint_cache_dir="/tmp/x")
    state_module._build_compiler(object(), 10, frozenset({0}), settings)

    assert seen["max_cache_bytes"] == 12 * MiB and seen["disk_cache_bytes"] == 34 * MiB


def test_text_cache_fill_past_the_bound_keeps_the_most_recent_within_it():
    cache = TextCache(max_bytes=64 * 1024)
    calls = []

    @cache.cached
    def grammar(schema: str) -> str:
        calls.append(schema)
        return "root ::= " + schema

    schemas = [f"{i:04d}" + "x" * 4000 for i in range(100)]  # about 8 KB an entry, key and value
    for schema in schemas:
        grammar(schema)

    assert cache.bytes <= 64 * 1024 and 0 < len(cache) < 10
    kept = len(cache)
    assert [grammar(s) for s in schemas[-kept:]] == ["root ::= " + s for s in schemas[-kept:]]
    assert len(calls) == 100  # the most recent were hits
    grammar(schemas[0])
    assert len(calls) == 101  # the oldest had been evicted


def test_text_cache_keeps_none_and_skips_what_exceeds_the_bound():
    cache = TextCache(max_bytes=4096)
    calls = []

    @cache.cached
    def detect(source: str, flag: bool):
        calls.append(source)

    detect("t", True), detect("t", True), detect("y" * 10_000, False), detect("y" * 10_000, False)
    assert calls == ["t", "y" * 10_000, "y" * 10_000] and len(cache) == 1


def test_text_cache_flag_sizes_the_shared_cache():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert settings_from_args(parser.parse_args(["--text-cache-mb", "5"])).text_cache_mb == 5
    assert DERIVED_TEXT.max_bytes == Settings().text_cache_mb * MiB  # until a server sizes it
