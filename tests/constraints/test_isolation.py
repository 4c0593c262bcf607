"""Compile isolation: every compile runs in a worker process with a time budget and a memory
cap; the server process only loads results, and mask and acceptance always agree."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from constraints import (
    ConstraintCompiler,
    ConstraintMemoryError,
    ConstraintSpec,
    ConstraintTimeoutError,
    EmptyLanguageError,
)

from .conftest import VOCAB, allowed_ids, new_mask, walk_json, walk_text

HOOKS = "tests.constraints.worker_hooks:plan"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer exists, not even as a zombie."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def small(tok):
    """One worker, a 1.5 s budget, a 256 MB cap, and the test hooks."""
    c = ConstraintCompiler(tok, VOCAB, compile_timeout_s=1.5, max_workers=1, compile_memory_mb=256)
    c.PLAN_JOB = HOOKS
    assert c.wait_ready(120)
    yield c
    c.close()


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec("grammar_ebnf", 'root ::= "a" root'),
        ConstraintSpec("grammar_lark", 'start: "a" start'),
    ],
    ids=["ebnf", "lark"],
)
def test_no_base_case_grammar_is_400_quickly(compiler, spec):
    before = _rss_mb()
    start = time.monotonic()
    with pytest.raises(EmptyLanguageError) as info:
        compiler.compile(spec)
    assert time.monotonic() - start < 2.0
    assert info.value.code == "invalid_constraint" and "no finite output" in info.value.message
    assert _rss_mb() - before < 50  # the server process did not grow


def test_memory_cap_kills_the_worker_and_the_next_compile_works(small):
    pid = small.worker_pids()[0]
    with pytest.raises(ConstraintMemoryError) as info:
        small.compile(ConstraintSpec("choice", ["hog:1024", "b"]))
    assert "256 MB memory cap" in info.value.message and info.value.code == "constraint_memory_exceeded"
    assert small.compile(ConstraintSpec("choice", ["yes", "no"])).backend == "outlines"
    assert _gone(pid) and small.worker_pids() != [pid]


def test_real_compile_over_the_memory_cap(tok):
    # a counted repetition explodes outlines-core's token index (~3 GB): Rust aborts on the cap
    c = ConstraintCompiler(tok, VOCAB, compile_timeout_s=15, max_workers=1, compile_memory_mb=256)
    try:
        with pytest.raises(ConstraintMemoryError) as info:
            c.compile(ConstraintSpec("regex", "[a-z]{0,2000}", {"backend": "outlines"}))
        assert "256 MB memory cap" in info.value.message
        assert c.compile(ConstraintSpec("regex", r"\d{2}")).backend == "outlines"
    finally:
        c.close()


def test_time_budget_kills_the_worker_and_the_next_compile_works(small):
    pid = small.worker_pids()[0]
    start = time.monotonic()
    with pytest.raises(ConstraintTimeoutError) as info:
        small.compile(ConstraintSpec("choice", ["sleep:30", "b"]))
    assert time.monotonic() - start < 1.5 + 1
    assert "1.5 s budget" in info.value.message
    assert small.compile(ConstraintSpec("choice", ["on", "off"])).backend == "outlines"
    assert _gone(pid)


def test_budget_does_not_count_queue_time(small):
    # two 1 s jobs on one worker: the second waits ~1 s in the queue, yet each is within 1.5 s
    results: list = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = small.compile(ConstraintSpec("choice", ["sleep:1.0", f"queued-{i}"]))
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start >= 2.0
    assert all(getattr(r, "backend", None) == "outlines" for r in results), results


SAMPLES = [
    (ConstraintSpec("json_schema", {"type": "object", "properties": {"iso": {"type": "integer"}},
                                    "required": ["iso"]}), '{"iso": 7}', '{"iso": "x"}'),
    (ConstraintSpec("json_object"), '{"a": [1, 2]}', "[1]"),
    (ConstraintSpec("regex", r"iso-\d{3}"), "iso-123", "iso-12a"),
    (ConstraintSpec("grammar_ebnf", 'root ::= "iso" [0-9]+'), "iso42", "isoX"),
    (ConstraintSpec("grammar_lark", 'start: "iso" /[0-9]+/'), "iso42", "iso"),
    (ConstraintSpec("choice", ["iso-a", "iso-b"]), "iso-b", "iso-c"),
    (ConstraintSpec("structural_tag", {"structures": [{"begin": "<f>", "schema": {"type": "integer"},
                                                       "end": "</f>"}], "triggers": ["<f>"]}),
     "hi <f>12</f>", "hi <f>x</f>"),
]


def test_every_kind_compiles_in_a_worker(compiler, tok, monkeypatch):
    """With compiling and planning broken in this process, every kind still compiles: the
    work happens in the workers, and the matchers built here behave as before."""
    from constraints.backends import llguidance as backend_llguidance
    from constraints.backends import outlines as backend_outlines
    from constraints.backends import xgrammar as backend_xgrammar
    from constraints.compile import planner

    def broken(*args, **kwargs):
        raise AssertionError("compiled in the server process")

    monkeypatch.setattr(planner, "plan", broken)
    for cls in (backend_xgrammar.XGrammarBackend, backend_llguidance.LLGuidanceBackend,
                backend_outlines.OutlinesBackend):
        monkeypatch.setattr(cls, "compile", broken)
    for spec, good, bad in SAMPLES:
        compiled = compiler.compile(spec)
        assert walk_text(compiled, tok, good), (spec.kind, good)
        assert not walk_text(compiled, tok, bad), (spec.kind, bad)


def test_close_kills_every_worker(tok):
    c = ConstraintCompiler(tok, VOCAB, max_workers=1)
    assert c.wait_ready(120)
    pids = c.worker_pids()
    assert pids
    c.close()
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError):
        c.compile(ConstraintSpec("choice", ["a", "b"]))


# -- mask and acceptance agree ------------------------------------------------------------------


def agreement_walk(compiled, stops: tuple[int, ...] = (2,), runs: int = 12, steps: int = 40, seed: int = 0) -> int:
    """Drive matchers like the engine: sample any allowed token (stop tokens often), accept it,
    then take the forced tokens. Every allowed token must be accepted. Returns the steps taken."""
    rng = random.Random(seed)
    taken = 0
    for _ in range(runs):
        m = compiled.new_matcher()
        for _ in range(steps):
            mask = new_mask()
            m.fill_bitmask(mask, 0)
            ids = sorted(allowed_ids(mask))
            assert ids, "no token allowed before termination"
            allowed_stops = [t for t in ids if t in stops]
            t = rng.choice(allowed_stops) if allowed_stops and rng.random() < 0.2 else rng.choice(ids)
            assert m.accept_token(t), f"mask allowed {t} but the matcher refused it"
            taken += 1
            if m.is_terminated():
                break
            for f in m.forced_tokens():
                assert m.accept_token(f), f"forced token {f} refused"
            if m.is_terminated():
                break
    return taken


HOSTILE = "(x|x|x|y)*" * 50 + "[a-z]{1,1000}" * 20


@pytest.mark.parametrize("regex", [r"(a+)+$", r"(a|aa)*b", r"(x+x+)+y", r"^(ab|a)*c$"])
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_redos_regex_mask_and_accept_agree(compiler, regex, backend):
    compiled = compiler.compile(ConstraintSpec("regex", regex, {"backend": backend}))
    assert agreement_walk(compiled) > 0


def test_dfa_hostile_regex_goes_to_a_backend_without_a_dfa(compiler):
    compiled = compiler.compile(ConstraintSpec("regex", HOSTILE))
    assert compiled.backend == "xgrammar"
    agreement_walk(compiled, runs=4)


def test_llguidance_lexer_limit_keeps_mask_and_accept_in_agreement(compiler):
    # llguidance's lazy lexer runs out of states mid-generation on this regex: the matcher then
    # allows only stop tokens and accepts them, and reports the error
    compiled = compiler.compile(ConstraintSpec("regex", HOSTILE, {"backend": "llguidance"}))
    agreement_walk(compiled, runs=6, steps=60)
    m = compiled.new_matcher()
    rng = random.Random(1)
    for _ in range(200):
        mask = new_mask()
        m.fill_bitmask(mask, 0)
        ids = sorted(allowed_ids(mask))
        if m.error is not None:
            assert ids == [2] and m.accept_token(2) and m.is_terminated()
            break
        assert m.accept_token(rng.choice([t for t in ids if t != 2] or ids))
    else:
        pytest.fail("llguidance never hit its lexer limit")
    # a fresh sequence is not poisoned by the lexer another one filled up
    fresh = compiled.new_matcher()
    mask = new_mask()
    fresh.fill_bitmask(mask, 0)
    assert fresh.error is None and 2 not in allowed_ids(mask)


TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
    "required": ["name"], "additionalProperties": False}}}


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_recursive_ref_schema_mask_and_accept_agree(compiler, tok, backend):
    compiled = compiler.compile(ConstraintSpec("json_schema", TREE, {"backend": backend}))
    assert walk_json(compiled, tok, {"name": "a", "kids": [{"name": "b"}]})
    agreement_walk(compiled, runs=6, steps=30)


def test_stop_only_mask_on_error_is_int32_safe():
    from constraints.backends.llguidance import _bit

    row = torch.zeros((1, 2), dtype=torch.int32)
    row[0, 0] |= _bit(31)
    assert int(row[0, 0]) == -(1 << 31)


def test_wait_ready_can_be_asked_again_after_a_timeout_and_after_success():
    """wait_ready hands back every start-up signal it took, so later calls see the same starts."""
    from constraints.compile.workers import WorkerPool

    pool = WorkerPool(2, "tests.constraints.worker_hooks:slow_init", (1.0,), name="test-ready")
    try:
        assert not pool.wait_ready(0.01)
        assert pool.wait_ready(120)
        assert pool.wait_ready(0.01)  # everyone started: nothing to wait for, however often asked
        assert pool.run("tests.constraints.worker_hooks:echo", 7, timeout=30)[0] == 7
    finally:
        pool.close()
