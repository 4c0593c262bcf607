"""The on-disk compile cache: restarts and other processes reuse compiled payloads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from constraints import ConstraintCompiler, ConstraintError, ConstraintSpec
from constraints.compile.disk_cache import DiskCache

from .conftest import VOCAB, walk_json, walk_text

NO_PLAN = "constraints.compile.jobs:no_such_job"  # a plan job that fails: nothing can compile

SCHEMA = ConstraintSpec(
    "json_schema",
    {"type": "object", "properties": {"disk_probe": {"type": "integer"}}, "required": ["disk_probe"]},
)
REGEX = ConstraintSpec("regex", r"[a-z]{3}-[0-9]{2}")
EBNF = ConstraintSpec("grammar_ebnf", 'root ::= "ab" [0-9]+ "!"')
# (spec, valid text, invalid text)
CASES = [
    (SCHEMA, None, None),
    (REGEX, "abc-12", "abc-1x"),
    (EBNF, "ab42!", "ab!"),
]


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.entry"))


def _restarted(tok, directory: Path, **kwargs) -> ConstraintCompiler:
    """A fresh compiler over ``directory`` whose workers cannot compile anything."""
    c = ConstraintCompiler(tok, VOCAB, max_workers=1, compile_timeout_s=2.0, disk_cache_dir=directory, **kwargs)
    c.PLAN_JOB = NO_PLAN
    return c


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("disk-cache")


@pytest.fixture(scope="module")
def writer(tok, cache_dir):
    """A working compiler over ``cache_dir`` that has compiled every case."""
    c = ConstraintCompiler(tok, VOCAB, max_workers=1, disk_cache_dir=cache_dir)
    assert c.wait_ready(120)
    for spec, _, _ in CASES:
        c.compile(spec)
    yield c
    c.close()


def test_restart_hits_disk(tok, writer, cache_dir):
    stats = writer.cache_stats()
    assert stats["disk_writes"] == len(CASES) and stats["disk_misses"] == len(CASES)
    assert len(_entries(cache_dir)) == len(CASES)
    c = _restarted(tok, cache_dir)
    try:
        compiled = {spec.kind: c.compile(spec) for spec, _, _ in CASES}
        stats = c.cache_stats()
        assert stats["disk_hits"] == len(CASES) and stats["disk_writes"] == 0 and stats["disk_errors"] == 0
        assert walk_json(compiled["json_schema"], tok, {"disk_probe": 7})
        assert not walk_json(compiled["json_schema"], tok, {"disk_probe": "7"})
        for spec, good, bad in CASES[1:]:
            assert walk_text(compiled[spec.kind], tok, good)
            assert not walk_text(compiled[spec.kind], tok, bad)
        assert c.compile(SCHEMA) is compiled["json_schema"]  # memory first
        assert c.cache_stats()["disk_hits"] == len(CASES)
        # nothing else compiles here, and that failure is not written
        with pytest.raises(ConstraintError):
            c.compile(ConstraintSpec("regex", "[0-9]{4}"))
        assert len(_entries(cache_dir)) == len(CASES)
    finally:
        c.close()


def test_other_tokenizer_or_spec_misses(tok, writer, cache_dir):
    other_tok = _restarted(tok, cache_dir, stop_token_ids=[0, 2])
    c = _restarted(tok, cache_dir)
    try:
        assert other_tok.fingerprint != writer.fingerprint
        with pytest.raises(ConstraintError):
            other_tok.compile(REGEX)
        changed = ConstraintSpec("regex", REGEX.source + "x")
        with pytest.raises(ConstraintError):
            c.compile(changed)
        for compiler in (other_tok, c):
            stats = compiler.cache_stats()
            assert stats["disk_misses"] == 1 and stats["disk_hits"] == 0
    finally:
        other_tok.close()
        c.close()


def test_entries_of_another_compiler_source_miss(tmp_path, monkeypatch):
    """A payload reflects Trellis's own rewrites of the spec: entries written before the
    constraints package changed are not served after it."""
    from constraints.compile import disk_cache

    before = DiskCache(tmp_path, 1 << 20)
    assert before.versions["trellis-constraints"] == disk_cache.compiler_digest()
    assert before.put(before.key("fp", "spec"), "outlines", b"payload")
    monkeypatch.setattr(disk_cache, "compiler_digest", lambda: "0123456789abcdef")
    after = DiskCache(tmp_path, 1 << 20)
    assert after.key("fp", "spec") != before.key("fp", "spec")
    assert after.get(after.key("fp", "spec")) is None and before.get(before.key("fp", "spec")) is not None


def test_failures_not_written(writer, cache_dir):
    before = set(_entries(cache_dir))
    writes = writer.cache_stats()["disk_writes"]
    with pytest.raises(ConstraintError):
        writer.compile(ConstraintSpec("regex", "[^\\s\\S]"))  # empty language
    assert writer.cache_stats()["disk_writes"] == writes
    assert set(_entries(cache_dir)) == before


def test_corrupt_entry_is_a_miss_and_rewritten(tok, writer, cache_dir):
    spec = ConstraintSpec("regex", "corrupt-[0-9]+")
    writer.compile(spec)
    disk = DiskCache(cache_dir, 1 << 30)
    path = disk.path(disk.key(writer.fingerprint, spec.key()))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    c = ConstraintCompiler(tok, VOCAB, max_workers=1, disk_cache_dir=cache_dir)
    try:
        compiled = c.compile(spec)
        stats = c.cache_stats()
        assert stats["disk_hits"] == 0 and stats["disk_errors"] == 1 and stats["disk_writes"] == 1
        assert walk_text(compiled, tok, "corrupt-12")
        assert path.read_bytes() == good
    finally:
        c.close()


def test_entry_that_does_not_load_is_removed(tok, writer, cache_dir):
    spec = ConstraintSpec("regex", "unloadable-[0-9]+")
    disk = DiskCache(cache_dir, 1 << 30)
    key = disk.key(writer.fingerprint, spec.key())
    assert disk.put(key, "xgrammar", "this is not a serialized grammar")
    c = _restarted(tok, cache_dir)
    try:
        with pytest.raises(ConstraintError):
            c.compile(spec)  # a miss, then the (failing) workers: never the bad entry's error
        stats = c.cache_stats()
        assert stats["disk_hits"] == 0 and stats["disk_misses"] == 1 and stats["disk_errors"] == 1
        assert not disk.path(key).exists()
    finally:
        c.close()


def test_size_bound_evicts_least_recently_used(tmp_path):
    disk = DiskCache(tmp_path, 1 << 20)
    keys = [disk.key("fp", f"spec{i}") for i in range(4)]
    for i, key in enumerate(keys[:3]):
        assert disk.put(key, "outlines", bytes(300_000))
        os.utime(disk.path(key), (1000.0 + i, 1000.0 + i))
    assert disk.get(keys[0]) is not None  # a hit makes the oldest the most recent
    assert disk.put(keys[3], "outlines", bytes(300_000))  # 4 x 300 KB > 1 MiB: one must go
    assert [disk.path(k).exists() for k in keys] == [True, False, True, True]
    assert sum(p.stat().st_size for p in _entries(tmp_path)) <= 1 << 20
    assert not disk.put(disk.key("fp", "huge"), "outlines", bytes(2 << 20))  # never fits
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_files_are_misses(tmp_path):
    disk = DiskCache(tmp_path, 1 << 20)
    key = disk.key("fp", "spec")
    assert disk.put(key, "xgrammar", "payload")
    assert disk.get(key) == ("xgrammar", "payload")
    other = disk.key("fp", "other")
    os.replace(disk.path(key), disk.path(other))  # an entry under the wrong name
    for data in (None, b"", b"garbage" * 10):
        if data is not None:
            disk.path(other).write_bytes(data)
        assert disk.get(other) is None and not disk.path(other).exists()
    assert disk.stats() == {"disk_hits": 1, "disk_misses": 3, "disk_writes": 1, "disk_errors": 3}


def test_concurrent_writers_of_one_key(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    caches = [DiskCache(tmp_path, 1 << 24) for _ in range(4)]  # as if four processes
    key = caches[0].key("fp", "spec")
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda i: caches[i % 4].put(key, "outlines", bytes(100_000)), range(32)))
    assert caches[1].get(key) == ("outlines", bytes(100_000))
    assert len(_entries(tmp_path)) == 1 and not list(tmp_path.glob("*.tmp"))
