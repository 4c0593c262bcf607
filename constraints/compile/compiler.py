"""ConstraintCompiler: picks a backend per request, compiles in worker processes with time and
memory budgets, caches.

No compile of unbounded cost runs in the server process: planning (schema analysis, emptiness
checks) and backend compiles run in :mod:`constraints.compile.workers`; the server process only loads
the payloads they return.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from ..backends.base import CompiledConstraint
from ..backends.json_checks import CheckedPayload, with_checks
from ..backends.canonical_keys import canonical_keys
from ..backends.number_bound import bound_numbers
from ..backends.messages import backend_message
from ..backends.registry import make_backend
from ..backends.vocabulary import TokenizerContext
from ..errors import (
    ConstraintError,
    ConstraintTimeoutError,
    ConstraintTooLargeError,
    EmptyLanguageError,
    InvalidConstraintError,
    UnsupportedConstraintError,
)
from ..spec import ConstraintSpec
from .disk_cache import DiskCache
from .workers import WorkerPool

FAILURE_TTL_S = 30.0  # failures are cached briefly: a retry storm must not recompile
_FAILURE_BYTES = 1024
_DISK_STATS = ("disk_hits", "disk_misses", "disk_writes", "disk_errors")


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> str:
    """Stable hash of the vocabulary, special tokens, logits width and stop ids."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\x00{tok}\x01".encode("utf-8", "surrogatepass"))
    h.update(repr((type(tokenizer).__name__, vocab_size, tuple(stop_ids))).encode())
    return h.hexdigest()[:32]


class _Cache:
    """LRU bounded in bytes; values are compiled constraints or (briefly) errors. Entries put
    with a ``ttl`` (failures) are dropped once expired, on the next get or put."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (value, bytes)
        self._expiring: OrderedDict[str, float] = OrderedDict()  # key -> expiry, oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            self._purge(time.monotonic())
            item = self._items.get(key)
            if item is None:
                return None  # misses are counted by the caller: joining an in-flight compile is none
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: str, value: Any, size: int, ttl: float = 0.0) -> None:
        size += len(key)
        with self._lock:
            now = time.monotonic()
            self._purge(now)
            if key in self._items:
                self._drop(key)
            if size > self.max_bytes:
                return
            self._items[key] = (value, size)
            if ttl:
                self._expiring[key] = now + ttl
            self.bytes += size
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _purge(self, now: float) -> None:
        # one TTL for every failure: expiries come in insertion order, the oldest first
        while self._expiring:
            key, expiry = next(iter(self._expiring.items()))
            if expiry > now:
                return
            self._drop(key)

    def _drop(self, key: str) -> None:
        _, size = self._items.pop(key)
        self._expiring.pop(key, None)
        self.bytes -= size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._items), "bytes": self.bytes}


def _bare(exc: ConstraintError) -> ConstraintError:
    """A copy of ``exc`` without traceback, cause or context. A cached failure is raised once per
    hit, and raising the same object again prepends the frames it passes through to its
    traceback (each holding that request's spec): only copies are ever raised."""
    return copy.copy(exc)


class ConstraintCompiler:
    """Compiles ConstraintSpecs for one tokenizer; thread-safe; build once per tokenizer.

    ``vocab_size`` is the model's logits width (may exceed the tokenizer's vocabulary);
    ``stop_token_ids`` defaults to the tokenizer's EOS. Every compile runs in a pool of
    ``max_workers`` worker processes (the tokenizer must pickle): each compile gets
    ``compile_timeout_s`` seconds of worker time, counted from when a worker takes it, and may
    grow its worker by ``compile_memory_mb`` MiB (0: no cap); a worker over either is killed and
    replaced. The server process only loads what a worker already built. Results (and, briefly,
    failures) are cached in an LRU bounded by ``max_cache_bytes``.

    With ``disk_cache_dir``, successful compiles are also kept on disk (at most
    ``disk_cache_bytes``; see :mod:`constraints.compile.disk_cache`), shared by every compiler over the
    same directory, across processes and restarts: a spec is looked up in memory, then on disk,
    and only then compiled. The directory holds pickles and must be the operator's own.
    """

    PLAN_JOB = "constraints.compile.jobs:plan"  # worker functions (tests substitute their own)
    ATTEMPT_JOB = "constraints.compile.jobs:attempt"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        compile_timeout_s: float = 5.0,
        max_cache_bytes: int = 256 << 20,
        max_workers: int = 2,
        compile_memory_mb: int = 4096,
        disk_cache_dir: str | os.PathLike | None = None,
        disk_cache_bytes: int = 1 << 30,
    ) -> None:
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        stops = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("the tokenizer has no EOS token: pass stop_token_ids")
        if compile_memory_mb < 0:
            raise ValueError("compile_memory_mb must be >= 0")
        self.compile_timeout_s = compile_timeout_s
        self.compile_memory_mb = compile_memory_mb
        self.fingerprint = tokenizer_fingerprint(tokenizer, vocab_size, stops)
        self._ctx = TokenizerContext(
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            tokenizer_vocab=min(len(tokenizer), vocab_size),
            stop_token_ids=stops,
            fingerprint=self.fingerprint,
        )
        self._pool = WorkerPool(
            max_workers,
            "constraints.compile.jobs:init",
            (tokenizer, vocab_size, stops, self.fingerprint),
            memory_mb=compile_memory_mb,
        )
        # these threads only wait on the workers: compiles queue for workers, not for threads
        self._executor = ThreadPoolExecutor(4 * max_workers, thread_name_prefix="trellis-compile")
        self._cache = _Cache(max_cache_bytes)
        self._disk = DiskCache(disk_cache_dir, disk_cache_bytes) if disk_cache_dir is not None else None
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._backends = {name: make_backend(name, self._ctx) for name in ("llguidance", "xgrammar", "outlines")}
        self._closed = False

    # -- public ------------------------------------------------------------------------------

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile (or fetch from cache) ``spec``; raises ConstraintError."""
        try:
            return self._submit(spec).result()
        except ConstraintError as exc:
            raise exc.for_param(spec.param) from None

    async def compile_async(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Like :meth:`compile` without blocking the event loop."""
        try:
            future = self._submit(spec)
            return await asyncio.shield(asyncio.wrap_future(future))
        except ConstraintError as exc:
            raise exc.for_param(spec.param) from None

    def cache_stats(self) -> dict[str, int]:
        """Cache counters: hits, misses, entries, bytes (memory) and disk_hits, disk_misses,
        disk_writes, disk_errors (all 0 without a disk cache)."""
        disk = self._disk.stats() if self._disk is not None else dict.fromkeys(_DISK_STATS, 0)
        return {**self._cache.stats(), **disk}

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the compile workers have started (they start with the compiler, in the
        background); False on timeout. Compiles before then simply wait for a worker."""
        return self._pool.wait_ready(timeout)

    def worker_pids(self) -> list[int]:
        """Process ids of the compile workers now alive."""
        return self._pool.pids()

    def close(self) -> None:
        """Kill the workers (running compiles fail)."""
        self._closed = True
        self._pool.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- scheduling ----------------------------------------------------------------------------

    def _cache_key(self, spec: ConstraintSpec) -> str:
        return self.fingerprint + ":" + spec.key()

    def _submit(self, spec: ConstraintSpec) -> Future:
        key = self._cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                done: Future = Future()
                if isinstance(hit, ConstraintError):
                    done.set_exception(_bare(hit))
                else:
                    done.set_result(hit)
                return done
            future = self._inflight.get(key)
            if future is not None:
                return future
            if self._closed:
                raise RuntimeError("ConstraintCompiler is closed")
            self._cache.misses += 1
            future = self._executor.submit(self._compile_and_cache, spec, key)
            self._inflight[key] = future
            return future

    def _compile_and_cache(self, spec: ConstraintSpec, key: str) -> CompiledConstraint:
        try:
            compiled = self._load_from_disk(spec)
            if compiled is None:
                compiled = self._compile_to_disk(spec)
            compiled = canonical_keys(spec, bound_numbers(spec, compiled, self._ctx), self._ctx)
        except ConstraintError as exc:
            self._finish(key, _bare(exc), _FAILURE_BYTES, FAILURE_TTL_S)
            raise
        except Exception as exc:
            if self._closed:
                self._finish(key, None, 0, 0.0)
                raise
            # a backend bug must become a clean 400, not a crash
            err = UnsupportedConstraintError(f"constraint compilation failed: {type(exc).__name__}: {backend_message(str(exc))}")
            self._finish(key, _bare(err), _FAILURE_BYTES, FAILURE_TTL_S)
            raise err from exc
        self._finish(key, compiled, compiled.size_bytes(), 0.0)
        return compiled

    def _finish(self, key: str, value: Any, size: int, ttl: float) -> None:
        with self._lock:
            if key in self._inflight:
                del self._inflight[key]
                if value is not None:
                    self._cache.put(key, value, size, ttl)

    # -- the disk cache: entries are (backend, payload) of the winning attempt ----------------

    def _load_from_disk(self, spec: ConstraintSpec) -> CompiledConstraint | None:
        """The compiled constraint from the disk cache, or None on a miss or a bad entry."""
        if self._disk is None:
            return None
        key = self._disk.key(self.fingerprint, spec.key())
        entry = self._disk.get(key)
        if entry is None:
            return None
        backend, payload = entry
        try:
            return self._load(backend, spec, payload)
        except Exception:
            self._disk.load_failed(key)
            return None

    def _compile_to_disk(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile in the workers; store the winning payload on disk when there is a disk cache."""
        compiled, backend, payload = self._compile_now(spec)
        if self._disk is not None:
            self._disk.put(self._disk.key(self.fingerprint, spec.key()), backend, payload)
        return compiled

    # -- one compile: plan and attempts, each in a worker -------------------------------------

    def _timeout_error(self) -> ConstraintTimeoutError:
        return ConstraintTimeoutError(
            f"compiling the constraint exceeded the {self.compile_timeout_s:g} s budget"
        )

    def _compile_now(self, spec: ConstraintSpec) -> tuple[CompiledConstraint, str, Any]:
        """The compiled constraint with the backend and worker payload it was loaded from."""
        budget = _Budget(self.compile_timeout_s)
        attempts = budget.run(self._pool, self.PLAN_JOB, spec)
        errors: list[ConstraintError] = []
        i = 0
        while i < len(attempts):
            attempt, last = attempts[i], i == len(attempts) - 1
            if budget.left() <= 0:
                raise self._timeout_error()
            try:
                return self._try(attempt, spec, budget, last)
            except (InvalidConstraintError, ConstraintTimeoutError) as exc:
                if last or attempt.final_on_invalid or isinstance(exc, EmptyLanguageError):
                    raise
                errors.append(exc)
            except ConstraintError as exc:
                errors.append(exc)
            if isinstance(errors[-1], (ConstraintTimeoutError, ConstraintTooLargeError)):
                attempts.after_blowup(i)
            i += 1
        raise attempts.failure(errors)

    def _try(
        self, attempt: Any, spec: ConstraintSpec, budget: "_Budget", last: bool
    ) -> tuple[CompiledConstraint, str, Any]:
        # a DFA that explodes gets half the budget; the lazy backends get the rest
        share = 1.0 if last or attempt.backend != "outlines" else 0.5
        payload = budget.run(self._pool, self.ATTEMPT_JOB, spec, attempt, share=share)
        if attempt.checks:
            payload = CheckedPayload(payload, attempt.checks)
        return self._load(attempt.backend, spec, payload), attempt.backend, payload

    def _load(self, backend: str, spec: ConstraintSpec, payload: Any) -> CompiledConstraint:
        """The compiled constraint of a worker's payload (with its run-time checks, if any)."""
        if isinstance(payload, CheckedPayload):
            return with_checks(self._backends[backend].load(spec, payload.payload), payload.checks, self._ctx)
        return self._backends[backend].load(spec, payload)


class _Budget:
    """Worker seconds one compile may still spend (time queued for a worker is not counted)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0

    def left(self) -> float:
        return self.seconds - self.spent

    def run(self, pool: WorkerPool, fn: str, *args: Any, share: float = 1.0) -> Any:
        """``fn(*args)`` in a worker within ``share`` of the budget left."""
        try:
            result, took = pool.run(fn, *args, timeout=max(0.05, self.left() * share))
        except BaseException as exc:
            self.spent += getattr(exc, "elapsed", 0.0)
            if isinstance(exc, ConstraintTimeoutError):
                raise ConstraintTimeoutError(
                    f"compiling the constraint exceeded the {self.seconds:g} s budget"
                ) from None
            raise
        self.spent += took
        return result
