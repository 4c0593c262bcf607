"""A pool of killable worker processes: every compile of unbounded cost runs in one of them.

A worker is a plain ``python -m constraints.compile.workers`` subprocess speaking length-prefixed
pickles over its pipes: unlike multiprocessing's spawn it never re-imports the parent's
``__main__``, and unlike a thread it can be killed. Each worker runs an init function once
(tokenizer tables), then caps its own address space (``RLIMIT_AS``) and serves calls one at a
time. A call's time budget starts when a worker takes it, not while it waits in the queue.
A worker over budget is killed; one that runs out of memory exits (or is aborted by its
allocator); either way it is replaced and the caller gets a :class:`ConstraintError`.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import queue
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ConstraintCrashError, ConstraintError, ConstraintMemoryError, ConstraintTimeoutError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
EXIT_MEMORY = 86  # a worker's exit status after an allocation failure
_STDERR_TAIL = 8192
# what allocators print when they give up: Rust aborts, C++ throws, Python raises
_MEMORY_HINTS = ("memory allocation of", "bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory")


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("worker process exited")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(fd: int, deadline: float | None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


class WorkerDied(Exception):
    """The worker process ended during a call (the reason is in ``error``)."""

    def __init__(self, error: ConstraintError) -> None:
        super().__init__(error.message)
        self.error = error


class _Worker:
    """One started, initialised worker process."""

    def __init__(self, init: str, initargs: tuple[Any, ...], memory_mb: int, start_timeout: float) -> None:
        self.memory_mb = memory_mb
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "constraints.compile.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self._tail = bytearray()
        self._reader = threading.Thread(target=self._drain, name="trellis-worker-stderr", daemon=True)
        self._reader.start()
        try:
            _send(self.proc.stdin, (init, initargs, memory_mb))
            ok, value = _recv(self.proc.stdout.fileno(), time.monotonic() + start_timeout)
        except (EOFError, OSError) as exc:  # TimeoutError included
            self.kill()
            raise RuntimeError(f"compile worker failed to start: {self.stderr_tail() or exc!r}") from None
        if not ok:
            self.kill()
            raise RuntimeError(f"compile worker failed to start: {value!r}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self._tail += line
            del self._tail[:-_STDERR_TAIL]
            log.debug("compile worker %d: %s", self.proc.pid, line.decode("utf-8", "replace").rstrip())

    def stderr_tail(self) -> str:
        self._reader.join(timeout=1.0)
        return bytes(self._tail).decode("utf-8", "replace").strip()

    def call(self, fn: str, args: tuple[Any, ...], timeout: float) -> Any:
        """``fn(*args)`` in the worker; TimeoutError past ``timeout`` s, WorkerDied if it ended."""
        deadline = time.monotonic() + timeout
        try:
            _send(self.proc.stdin, (fn, args))
            ok, value = _recv(self.proc.stdout.fileno(), deadline)
        except TimeoutError:  # an OSError too, but the worker is alive: the caller kills it
            raise
        except (EOFError, OSError):
            try:
                self.proc.wait(timeout=2.0)  # let it finish dying: its status tells why
            except subprocess.TimeoutExpired:
                self.kill()
            raise WorkerDied(self._death_error()) from None
        if ok:
            return value
        raise value

    def _death_error(self) -> ConstraintError:
        status = self.proc.returncode
        tail = self.stderr_tail()
        out_of_memory = status in (EXIT_MEMORY, -signal.SIGKILL) or any(h in tail for h in _MEMORY_HINTS)
        if out_of_memory:
            if self.memory_mb:
                return ConstraintMemoryError(
                    f"compiling the constraint exceeded the {self.memory_mb} MB memory cap"
                )
            return ConstraintMemoryError("compiling the constraint ran out of memory")
        how = f"signal {-status}" if status is not None and status < 0 else f"exit status {status}"
        last = tail.splitlines()[-1][:200] if tail else ""
        return ConstraintCrashError(f"the compile worker died ({how}){': ' + last if last else ''}")

    def kill(self) -> None:
        """Kill and reap the process (no zombie is left)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _Job:
    __slots__ = ("fn", "args", "timeout", "future")

    def __init__(self, fn: str, args: tuple[Any, ...], timeout: float) -> None:
        self.fn = fn
        self.args = args
        self.timeout = timeout
        self.future: Future = Future()
        self.future.elapsed = 0.0  # type: ignore[attr-defined]  # seconds a worker spent on it


class WorkerPool:
    """``size`` worker processes serving ``module:function`` calls from one queue.

    ``init`` ("module:function", run with ``initargs``) builds each fresh worker's state; then
    the worker's address space is capped at its size plus ``memory_mb`` (0: no cap). Workers
    start at once, in the pool's threads, and are replaced as soon as one is killed or dies.
    """

    def __init__(
        self,
        size: int,
        init: str,
        initargs: tuple[Any, ...],
        *,
        memory_mb: int = 0,
        start_timeout: float = 300.0,
        name: str = "trellis-compile-worker",
    ) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.memory_mb = memory_mb
        self._init = init
        self._initargs = initargs
        self._start_timeout = start_timeout
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[_Worker | None] = [None] * size
        self._lock = threading.Lock()
        self._closed = False
        self._first_starts = threading.Semaphore(0)  # released once per slot's first start attempt
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    # -- public ------------------------------------------------------------------------------

    def submit(self, fn: str, *args: Any, timeout: float) -> Future:
        """Queue ``fn(*args)``; the future's ``elapsed`` tells the seconds a worker spent on it."""
        job = _Job(fn, args, timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            self._queue.put(job)
        return job.future

    def run(self, fn: str, *args: Any, timeout: float) -> tuple[Any, float]:
        """Blocking :meth:`submit`: (result, seconds a worker spent on it); raises its error."""
        future = self.submit(fn, *args, timeout=timeout)
        try:
            return future.result(), future.elapsed  # type: ignore[attr-defined]
        except BaseException as exc:
            exc.elapsed = future.elapsed  # type: ignore[attr-defined]
            raise

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every worker has started (or failed to); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        acquired = 0
        for _ in self._threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._first_starts.acquire(timeout=left):
                break
            acquired += 1
        for _ in range(acquired):
            self._first_starts.release()  # every permit goes back: later callers see the same starts
        return acquired == len(self._threads)

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        with self._lock:
            return [w.pid for w in self._workers if w is not None]

    def close(self) -> None:
        """Kill every worker; queued and running calls fail."""
        with self._lock:
            self._closed = True
            workers = [w for w in self._workers if w is not None]
        for _ in self._threads:
            self._queue.put(None)
        for worker in workers:
            worker.kill()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        self._fail_queued()

    # -- worker threads ------------------------------------------------------------------------

    def _loop(self, slot: int) -> None:
        try:
            self._replace(slot)
        finally:
            self._first_starts.release()
        while True:
            job = self._queue.get()
            if job is None or self._closed:
                if job is not None:
                    job.future.set_exception(RuntimeError("the worker pool is closed"))
                break
            if job.future.set_running_or_notify_cancel():
                self._run_job(slot, job)
        self._retire(slot)

    def _run_job(self, slot: int, job: _Job) -> None:
        worker = self._workers[slot] or self._replace(slot, job=job)
        if worker is None:
            return
        started = time.monotonic()
        try:
            result = worker.call(job.fn, job.args, job.timeout)
        except TimeoutError:
            self._finish(job, started, error=ConstraintTimeoutError(
                f"compiling the constraint exceeded the {job.timeout:.3g} s budget"
            ))
            self._retire(slot)
            self._replace(slot)
        except WorkerDied as died:
            error = RuntimeError("the worker pool is closed") if self._closed else died.error
            self._finish(job, started, error=error)
            self._retire(slot)
            self._replace(slot)
        except BaseException as exc:  # the call's own exception, re-raised from the worker
            self._finish(job, started, error=exc)
        else:
            self._finish(job, started, result=result)

    @staticmethod
    def _finish(job: _Job, started: float, *, result: Any = None, error: BaseException | None = None) -> None:
        job.future.elapsed = time.monotonic() - started  # type: ignore[attr-defined]
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _replace(self, slot: int, job: _Job | None = None) -> _Worker | None:
        """Start a fresh worker in ``slot`` (start-up is outside any call's budget); a start-up
        failure goes to ``job`` when there is one."""
        if self._closed:
            if job is not None:
                job.future.set_exception(RuntimeError("the worker pool is closed"))
            return None
        try:
            worker = _Worker(self._init, self._initargs, self.memory_mb, self._start_timeout)
        except Exception as exc:
            log.error("%s", exc)
            if job is not None:
                job.future.set_exception(exc)
            return None
        with self._lock:
            if self._closed:
                worker.kill()
                worker.close_pipes()
                if job is not None:
                    job.future.set_exception(RuntimeError("the worker pool is closed"))
                return None
            self._workers[slot] = worker
        return worker

    def _retire(self, slot: int) -> None:
        with self._lock:
            worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()
            worker.close_pipes()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the worker pool is closed"))


# -- the worker process ------------------------------------------------------------------------


def _resolve(name: str) -> Any:
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def _vm_size() -> int:
    """This process's address-space size in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cap_memory(memory_mb: int) -> None:
    """Cap this process's address space at its current size plus ``memory_mb`` MiB."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + (memory_mb << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _allocation_failed(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "bad_alloc" in str(exc)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _serve() -> None:
    # the protocol gets a private copy of stdout; fd 1 goes to stderr so stray output from
    # native code cannot corrupt it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    init, initargs, memory_mb = _recv(0, None)
    try:
        _resolve(init)(*initargs)
    except BaseException as exc:
        _send(out, (False, _picklable(exc)))
        return
    if memory_mb:
        cap_memory(memory_mb)
    _send(out, (True, "ready"))
    while True:
        try:
            fn, args = _recv(0, None)
        except EOFError:
            return
        try:
            reply = (True, _resolve(fn)(*args))
        except BaseException as exc:
            if _allocation_failed(exc):
                os._exit(EXIT_MEMORY)  # the heap may be in pieces: a fresh worker takes over
            reply = (False, _picklable(exc))
        try:
            _send(out, reply)
        except MemoryError:
            os._exit(EXIT_MEMORY)


if __name__ == "__main__":
    _serve()
