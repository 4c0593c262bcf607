"""ConstraintCompiler: picks a backend per request, compiles off-loop with budgets, caches."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .backend import Backend, CompiledConstraint, TokenizerContext
from .errors import (
    ConstraintError,
    ConstraintTimeoutError,
    EmptyLanguageError,
    InvalidConstraintError,
    UnsupportedConstraintError,
)
from .spec import ConstraintSpec

FAILURE_TTL_S = 30.0  # failures are cached briefly: a retry storm must not recompile
_FAILURE_BYTES = 1024


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> str:
    """Stable hash of the vocabulary, special tokens, logits width and stop ids."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\x00{tok}\x01".encode("utf-8", "surrogatepass"))
    h.update(repr((type(tokenizer).__name__, vocab_size, tuple(stop_ids))).encode())
    return h.hexdigest()[:32]


class _Cache:
    """LRU bounded in bytes; values are compiled constraints or (error, expiry)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[Any, int, float]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[2] and item[2] < time.monotonic():
                self._drop(key)
                item = None
            if item is None:
                return None  # misses are counted by the caller: joining an in-flight compile is none
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: str, value: Any, size: int, ttl: float = 0.0) -> None:
        size += len(key)
        with self._lock:
            if key in self._items:
                self._drop(key)
            if size > self.max_bytes:
                return
            self._items[key] = (value, size, time.monotonic() + ttl if ttl else 0.0)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, key: str) -> None:
        _, size, _ = self._items.pop(key)
        self.bytes -= size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._items), "bytes": self.bytes}


class ConstraintCompiler:
    """Compiles ConstraintSpecs for one tokenizer; thread-safe; build once per tokenizer.

    ``vocab_size`` is the model's logits width (may exceed the tokenizer's vocabulary);
    ``stop_token_ids`` defaults to the tokenizer's EOS. Each compile runs on a worker with a
    ``compile_timeout_s`` budget; results (and, briefly, failures) are cached in an LRU bounded
    by ``max_cache_bytes``.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        compile_timeout_s: float = 5.0,
        max_cache_bytes: int = 256 << 20,
        max_workers: int = 2,
    ) -> None:
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        stops = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("the tokenizer has no EOS token: pass stop_token_ids")
        self.compile_timeout_s = compile_timeout_s
        self.fingerprint = tokenizer_fingerprint(tokenizer, vocab_size, stops)
        self._ctx = TokenizerContext(
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            tokenizer_vocab=min(len(tokenizer), vocab_size),
            stop_token_ids=stops,
            fingerprint=self.fingerprint,
        )
        self._max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="trellis-compile")
        self._cache = _Cache(max_cache_bytes)
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._backends: dict[str, Backend] = {}
        self._backend_lock = threading.Lock()
        self._closed = False
        for name in ("llguidance", "xgrammar"):  # tokenizer tables once, outside any budget
            self._backend(name)

    # -- public ------------------------------------------------------------------------------

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile (or fetch from cache) ``spec``; raises ConstraintError."""
        try:
            future, started = self._submit(spec)
            return self._wait(spec, future, started)
        except ConstraintError as exc:
            raise exc.for_param(spec.param) from None

    async def compile_async(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Like :meth:`compile` without blocking the event loop."""
        try:
            future, started = self._submit(spec)
            if not future.done():
                remaining = max(0.0, started + self.compile_timeout_s - time.monotonic())
                await asyncio.wait(
                    [asyncio.shield(asyncio.wrap_future(future))], timeout=remaining + 0.05
                )
            return self._wait(spec, future, started)
        except ConstraintError as exc:
            raise exc.for_param(spec.param) from None

    def cache_stats(self) -> dict[str, int]:
        """Cache counters: hits, misses, entries, bytes."""
        return self._cache.stats()

    def close(self) -> None:
        """Stop the workers (running compiles are abandoned)."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        for backend in self._backends.values():
            close = getattr(backend, "close", None)
            if close:
                close()

    # -- scheduling ----------------------------------------------------------------------------

    def _cache_key(self, spec: ConstraintSpec) -> str:
        return self.fingerprint + ":" + spec.key()

    def _submit(self, spec: ConstraintSpec) -> tuple[Future, float]:
        key = self._cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                done: Future = Future()
                if isinstance(hit, ConstraintError):
                    done.set_exception(hit)
                else:
                    done.set_result(hit)
                return done, time.monotonic()
            future = self._inflight.get(key)
            if future is not None:
                return future, future.started  # type: ignore[attr-defined]
            if self._closed:
                raise RuntimeError("ConstraintCompiler is closed")
            self._cache.misses += 1
            future = self._executor.submit(self._compile_and_cache, spec, key)
            future.started = time.monotonic()  # type: ignore[attr-defined]
            self._inflight[key] = future
            return future, future.started  # type: ignore[attr-defined]

    def _wait(self, spec: ConstraintSpec, future: Future, started: float) -> CompiledConstraint:
        remaining = started + self.compile_timeout_s - time.monotonic()
        try:
            return future.result(timeout=max(0.0, remaining) + 0.05)
        except TimeoutError:
            self._on_timeout(spec, future)
            raise self._timeout_error() from None

    def _timeout_error(self) -> ConstraintTimeoutError:
        return ConstraintTimeoutError(
            f"compiling the constraint exceeded the {self.compile_timeout_s:g} s budget"
        )

    def _on_timeout(self, spec: ConstraintSpec, future: Future) -> None:
        # A thread cannot be killed: give its pool up so later compiles get fresh workers.
        key = self._cache_key(spec)
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]
                self._cache.put(key, self._timeout_error(), _FAILURE_BYTES, ttl=FAILURE_TTL_S)
                old, self._executor = self._executor, ThreadPoolExecutor(
                    self._max_workers, thread_name_prefix="trellis-compile"
                )
                old.shutdown(wait=False, cancel_futures=False)

    def _compile_and_cache(self, spec: ConstraintSpec, key: str) -> CompiledConstraint:
        deadline = time.monotonic() + self.compile_timeout_s
        try:
            compiled = self._compile_now(spec, deadline)
        except ConstraintError as exc:
            self._finish(key, exc, _FAILURE_BYTES, FAILURE_TTL_S)
            raise
        except Exception as exc:  # a backend bug must become a clean 400, not a crash
            err = UnsupportedConstraintError(f"constraint compilation failed: {type(exc).__name__}: {exc}")
            self._finish(key, err, _FAILURE_BYTES, FAILURE_TTL_S)
            raise err from exc
        self._finish(key, compiled, compiled.size_bytes(), 0.0)
        return compiled

    def _finish(self, key: str, value: Any, size: int, ttl: float) -> None:
        with self._lock:
            if key in self._inflight:
                del self._inflight[key]
                self._cache.put(key, value, size, ttl)

    # -- backend choice ------------------------------------------------------------------------

    def _backend(self, name: str) -> Backend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = _make_backend(name, self._ctx, self.compile_timeout_s)
                self._backends[name] = backend
            return backend

    def _compile_now(self, spec: ConstraintSpec, deadline: float) -> CompiledConstraint:
        from .planner import plan

        attempts = plan(spec)
        errors: list[ConstraintError] = []
        for i, attempt in enumerate(attempts):
            if time.monotonic() > deadline:
                raise self._timeout_error()
            last = i == len(attempts) - 1
            try:
                return self._try(attempt, spec, deadline, last)
            except (InvalidConstraintError, ConstraintTimeoutError) as exc:
                if last or attempt.final_on_invalid or isinstance(exc, EmptyLanguageError):
                    raise
                errors.append(exc)
            except ConstraintError as exc:
                errors.append(exc)
        raise attempts.failure(errors)

    def _try(self, attempt: Any, spec: ConstraintSpec, deadline: float, last: bool) -> CompiledConstraint:
        backend = self._backend(attempt.backend)
        remaining = max(0.05, deadline - time.monotonic())
        if attempt.backend == "outlines":
            # a DFA that explodes gets half the budget; the lazy backends get the rest
            budget = remaining if last else remaining / 2
            return backend.compile(spec, attempt.source, timeout=budget)  # type: ignore[call-arg]
        return backend.compile(spec, attempt.source)


def _make_backend(name: str, ctx: TokenizerContext, timeout_s: float) -> Backend:
    if name == "xgrammar":
        from .backend_xgrammar import XGrammarBackend

        return XGrammarBackend(ctx)
    if name == "llguidance":
        from .backend_llguidance import LLGuidanceBackend

        return LLGuidanceBackend(ctx)
    if name == "outlines":
        from .backend_outlines import OutlinesBackend

        return OutlinesBackend(ctx, timeout_s)
    raise UnsupportedConstraintError(f"unknown backend {name!r}")
