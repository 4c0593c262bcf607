"""The compiled-constraint cache stays within its byte bound, keeps the most recent entries, drops
expired failures, and never lets a cached failure grow (issue 31, "memory stays flat")."""

from __future__ import annotations

import pytest

from constraints import ConstraintError, ConstraintSpec
from constraints.compile import compiler as compiler_module
from constraints.compile.compiler import _Cache
from constraints.errors import InvalidConstraintError


def test_fill_past_the_bound_keeps_the_most_recent_within_it():
    cache = _Cache(max_bytes=10_000)
    for i in range(100):
        cache.put(f"k{i:03d}", object(), size=996)  # 1,000 bytes with the key

    stats = cache.stats()
    assert stats["bytes"] <= 10_000 and stats["entries"] == 10
    assert all(cache.get(f"k{i:03d}") is not None for i in range(90, 100))
    assert cache.get("k000") is None and cache.get("k089") is None


def test_a_hit_keeps_an_entry_from_eviction():
    cache = _Cache(max_bytes=3_000)
    for key in ("a", "b", "c"):
        cache.put(key, key, size=999)
    assert cache.get("a") == "a"  # now the most recently used
    cache.put("d", "d", size=999)

    assert cache.get("b") is None and [cache.get(k) for k in ("a", "c", "d")] == ["a", "c", "d"]


def test_an_entry_over_the_whole_bound_is_not_kept():
    cache = _Cache(max_bytes=1_000)
    cache.put("small", 1, size=10)
    cache.put("huge", 2, size=5_000)

    assert cache.get("huge") is None and cache.get("small") == 1
    assert cache.stats()["bytes"] == 10 + len("small")


def test_expired_failures_go_on_the_next_put_without_being_asked_for(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(compiler_module.time, "monotonic", lambda: clock[0])
    cache = _Cache(max_bytes=1 << 20)
    for i in range(50):
        cache.put(f"fail{i}", InvalidConstraintError("no"), size=1024, ttl=30.0)
    cache.put("ok", "compiled", size=100)
    clock[0] += 31.0
    cache.put("later", "compiled", size=100)

    assert cache.stats()["entries"] == 2 and cache.stats()["bytes"] == 200 + len("ok") + len("later")


class _Tokenizer:
    eos_token_id = 0

    def get_vocab(self) -> dict[str, int]:
        return {"<eos>": 0, "a": 1}

    def __len__(self) -> int:
        return 2


class _RefusingPool:
    """Stands for the worker processes: every plan refuses the spec."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def run(self, fn, *args, timeout):
        raise InvalidConstraintError("refused")

    def close(self) -> None:
        pass


@pytest.fixture
def refusing_compiler(monkeypatch):
    monkeypatch.setattr(compiler_module, "WorkerPool", _RefusingPool)
    monkeypatch.setattr(compiler_module, "make_backend", lambda name, ctx: None)
    compiler = compiler_module.ConstraintCompiler(_Tokenizer(), 2, max_cache_bytes=1 << 20)
    yield compiler
    compiler.close()


def test_a_cached_failure_is_raised_as_a_fresh_copy(refusing_compiler):
    """Raising one exception object again prepends frames (each holding that request's spec) to
    its traceback: every hit must raise a copy, and the cached error carries no traceback."""
    spec = ConstraintSpec("regex", "a+", param="guided_regex")
    raised = []
    for _ in range(3):
        with pytest.raises(ConstraintError) as info:
            refusing_compiler.compile(spec)
        raised.append(info.value.__context__ or info.value)

    assert len({id(e) for e in raised}) == 3
    assert refusing_compiler.cache_stats()["hits"] == 2
    cached = refusing_compiler._cache.get(refusing_compiler._cache_key(spec))
    assert isinstance(cached, InvalidConstraintError) and cached.__traceback__ is None
    assert cached.__cause__ is None and cached.__context__ is None



def test_long_client_regexes_are_not_kept_by_the_regex_caches():
    """The regex front end's and the pattern-language caches are bounded by count, so their keys
    (client text) must be short: a long pattern is worked out every time instead."""
    from constraints.regex import disjoint, frontend

    frontend._resolve_cached.cache_clear()  # room for one more entry, however many tests ran before
    cached = frontend._resolve_cached.cache_info().currsize
    frontend._resolve_once("q" * (frontend.CACHED_REGEX_CHARS + 1), False)
    assert frontend._resolve_cached.cache_info().currsize == cached
    frontend._resolve_once("cache-bounds-[0-9]+", False)  # a short one is remembered
    assert frontend._resolve_cached.cache_info().currsize == cached + 1
    cached = disjoint._pattern_language.cache_info().currsize
    assert disjoint.pattern_language("b" * (disjoint.MAX_PATTERN_CHARS + 1)) is None
    assert disjoint._pattern_language.cache_info().currsize == cached
