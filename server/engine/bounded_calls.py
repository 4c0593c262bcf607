"""Calls that may never return, run on a worker thread under a time bound.

The engine calls code it cannot vouch for once per row and step: constraint backends (native
matchers: the mask fill, accepting a token, forced tokens, rollback) and client logit
processors. A call that never returns must not hold the engine thread, and a thread cannot be
stopped from outside, so :class:`BoundedCalls` runs such calls on a worker thread while the
caller waits with a timeout:

- ``start(calls)`` queues ``[(key, fn), ...]`` on the worker, which runs them in order;
  ``wait(batch)`` returns once they have run, with the keys of the calls it abandoned. Each
  call has ``timeout_s`` from when it starts; one still running then is abandoned together
  with its worker thread (never joined, never handed work again), and a fresh worker runs the
  calls after it. A batch per step costs one thread hand-off (some 15 µs on an idle core), not
  one per call.
- A call that walks several rows' objects (the draft planner, over their matchers) gets them
  :class:`Watched`: each of their method calls is bounded on its own and charged to its row's
  key, so only the row that hung is abandoned, and a long walk of quick calls is no timeout.
- An abandoned call may still return later; its worker then stops at once, at the end of the
  call or at its next Watched call (which raises instead). Whatever the call touches (its
  row's objects, the arguments it was given) must be left to it: the caller drops them (the
  engine ends the row and drops its matcher; the mask fill uploads a copy of the buffer the
  call wrote).

Pure Python that loops holding the GIL still lets the caller time it out (the interpreter
switches threads); a native call that never releases the GIL stops the whole process, and no
thread can help with that.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger("trellis.engine")

K = TypeVar("K")
T = TypeVar("T")

_running = threading.local()  # .batch: the batch this worker thread runs


class CallTimeout(TimeoutError):
    """:meth:`BoundedCalls.call`'s call did not return in time (it was abandoned)."""


class _Abandoned(BaseException):
    """Stops an abandoned worker at its next step (a BaseException: the calls' handlers let it by)."""


class Batch(Generic[K]):
    """Calls queued on a worker, and how far the worker got (read by the waiting thread)."""

    def __init__(self, calls: Sequence[tuple[K, Callable[[], Any]]], first: int, inference: bool,
                 error: BaseException | None = None) -> None:
        self.calls = calls
        self.first = first  # calls before it ran in an earlier batch (one abandoned meanwhile)
        self.inference = inference  # the caller's torch inference mode, which the calls run in
        self.error = error  # the first exception a call raised
        self.done = threading.Lock()
        self.done.acquire()  # released by the worker once every call has run
        self.abandoned = False
        self._lock = threading.Lock()
        # (index of the running call, its key, when it started); replaced, never mutated
        self.progress: tuple[int, Any, float] = (first, self._key(first), time.monotonic())

    def run(self) -> None:
        """On the worker: every call in order, unless the batch is abandoned meanwhile."""
        _running.batch = self
        try:
            with torch.inference_mode(self.inference):
                for index in range(self.first, len(self.calls)):
                    self._advance(index, self.calls[index][0])
                    self._call(self.calls[index][1])
                self._advance(len(self.calls), None)
            self.done.release()
        except _Abandoned:
            pass
        finally:
            _running.batch = None

    def _call(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except _Abandoned:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, as if it had made the call
            if self.error is None:
                self.error = exc

    def enter(self, key: Any) -> None:
        """A watched call charged to ``key`` starts within the running call."""
        self._advance(self.progress[0], key)

    def leave(self) -> None:
        """The watched call returned: the running call is charged again, its clock restarted."""
        index = self.progress[0]
        self._advance(index, self._key(index))

    def _advance(self, index: int, key: Any) -> None:
        with self._lock:  # the waiting thread abandons a batch only while its progress stands still
            if self.abandoned:
                raise _Abandoned
            self.progress = (index, key, time.monotonic())

    def abandon_if(self, progress: tuple[int, Any, float]) -> bool:
        """Abandon the batch if it has not moved on since ``progress``."""
        with self._lock:
            if self.progress is progress:
                self.abandoned = True
            return self.abandoned

    def _key(self, index: int) -> Any:
        return self.calls[index][0] if index < len(self.calls) else None


class _Worker:
    """One thread running batches; once abandoned it ends after its current batch."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            batch = self.inbox.get()
            if batch is None:
                return
            batch.run()
            if self.abandoned or batch.abandoned:
                return
            del batch  # an idle worker must not keep its last calls' objects (an engine, its KV cache) alive


class BoundedCalls:
    """Runs calls on a worker thread, each within ``timeout_s`` seconds of its start (see the
    module docstring). ``timeout_s`` None or 0: no bound; :meth:`run` and :meth:`call` then call
    on the caller's thread (no hand-off), :meth:`start` still on the worker (the caller goes on).

    One batch at a time: a batch started while another was never waited for waits for that one
    first (its results are lost: a step that failed half-way)."""

    def __init__(self, timeout_s: float | None, name: str = "trellis-bounded") -> None:
        self.timeout_s = timeout_s or None
        self.abandoned = 0  # calls abandoned so far (each left a worker thread behind)
        self._name = name
        self._worker = _Worker(name)
        self._outstanding: Batch | None = None

    @property
    def bounded(self) -> bool:
        return self.timeout_s is not None

    def start(self, calls: Sequence[tuple[K, Callable[[], Any]]]) -> Batch[K]:
        """Queue ``calls`` on the worker; :meth:`wait` for them."""
        if self._outstanding is not None:
            log.warning("a batch of bounded calls was never waited for; waiting for it now")
            self.wait(self._outstanding)
        batch = Batch(calls, 0, torch.is_inference_mode_enabled())
        self._outstanding = batch
        self._worker.inbox.put(batch)
        return batch

    def wait(self, batch: Batch[K]) -> list[K]:
        """Block until every call of ``batch`` has run or was abandoned; the keys of the abandoned
        calls (in order). Re-raises the first exception a call raised."""
        self._outstanding = None
        abandoned: list[K] = []
        while not self._settled(batch):
            index, key, _ = batch.progress
            abandoned.append(key)
            batch = self._restart(batch, index + 1)
        if batch.error is not None:
            raise batch.error
        return abandoned

    def run(self, calls: Sequence[tuple[K, Callable[[], Any]]]) -> list[K]:
        """:meth:`start` then :meth:`wait`; on the caller's thread when unbounded."""
        if not calls:
            return []
        if self.timeout_s is None:
            for _, fn in calls:
                fn()
            return []
        return self.wait(self.start(calls))

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` within the bound; raises :class:`CallTimeout` when it was abandoned."""
        if self.timeout_s is None:
            return fn()
        result: list[T] = []
        if self.run([(None, lambda: result.append(fn()))]):
            raise CallTimeout(f"the call did not return within {self.timeout_s:g} s")
        return result[0]

    def shutdown(self) -> None:
        """End the worker (once it is idle); abandoned ones end when their call returns, if ever."""
        self._worker.inbox.put(None)

    def _settled(self, batch: Batch) -> bool:
        """Wait for ``batch``: True when it ran to its end, False when its running call is over
        the bound (the batch is then abandoned)."""
        if self.timeout_s is None:
            batch.done.acquire()
            return True
        while True:
            progress = batch.progress
            left = progress[2] + self.timeout_s - time.monotonic()
            if batch.done.acquire(timeout=max(left, 0.0)):
                return True
            if left <= 0 and batch.abandon_if(progress):
                return False

    def _restart(self, batch: Batch, first: int) -> Batch:
        """Leave ``batch``'s worker to its stuck call; a fresh worker runs the calls from ``first``."""
        self.abandoned += 1
        log.error("a bounded call did not return within %g s: abandoned with its worker thread "
                  "(%d so far)", self.timeout_s, self.abandoned)
        self._worker.abandoned = True
        self._worker = _Worker(self._name)
        rest = Batch(batch.calls, first, batch.inference, batch.error)
        self._worker.inbox.put(rest)
        return rest


class Watched:
    """``target`` (e.g. a matcher) whose method calls, made inside a running bounded call, are
    bounded calls of their own charged to ``key``; elsewhere they are plain calls. Plain
    attributes are read through."""

    def __init__(self, target: Any, key: Any) -> None:
        self._target = target
        self._key = key

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value) or name.startswith("__"):
            return value
        method = partial(_watched_call, self._key, value)
        self.__dict__[name] = method  # later lookups skip __getattr__
        return method


def _watched_call(key: Any, method: Callable, *args: Any, **kwargs: Any) -> Any:
    batch = getattr(_running, "batch", None)
    if batch is None:
        return method(*args, **kwargs)
    batch.enter(key)  # raises _Abandoned in an abandoned worker: the call is not made
    try:
        return method(*args, **kwargs)
    finally:
        batch.leave()  # likewise, once a call it was abandoned in returns
