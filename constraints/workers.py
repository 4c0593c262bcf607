"""A killable worker process for compiles that may run unbounded (regex -> token DFA).

The worker is a plain ``python -m constraints.workers`` subprocess speaking length-prefixed
pickles over its pipes: unlike multiprocessing's spawn it never re-imports the parent's
``__main__``, and unlike a thread it can be killed.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

from .errors import ConstraintTimeoutError

_HEADER = struct.Struct("<Q")


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    import time

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


class ProcessRunner:
    """Runs ``module:function(*args)`` in one worker process; kills it on timeout.

    ``init`` ("module:function", args) runs once in each fresh worker (e.g. to build a
    vocabulary). The worker restarts lazily after a kill or a crash.
    """

    def __init__(self, init: str, initargs: tuple[Any, ...]) -> None:
        self._init = init
        self._initargs = initargs
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen(
            [sys.executable, "-m", "constraints.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        _send(proc.stdin, (self._init, self._initargs))
        return proc

    def run(self, fn: str, *args: Any, timeout: float) -> Any:
        """Call ``fn`` ("module:function") with ``args`` in the worker within ``timeout`` s."""
        import time

        deadline = time.monotonic() + timeout
        with self._lock:  # one request at a time per worker
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                _send(proc.stdin, (fn, args))
                ok, value = _recv(proc.stdout.fileno(), deadline)
            except TimeoutError:
                self._kill()
                raise ConstraintTimeoutError(f"compilation exceeded the {timeout:g} s budget") from None
            except (EOFError, BrokenPipeError, OSError) as exc:
                self._kill()
                raise RuntimeError(f"compile worker died: {exc}") from None
        if ok:
            return value
        raise value

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                stream.close()

    def close(self) -> None:
        with self._lock:
            self._kill()


def _resolve(name: str) -> Any:
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def _serve() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    init, initargs = _recv(stdin.fileno(), None)
    _resolve(init)(*initargs)
    while True:
        try:
            fn, args = _recv(stdin.fileno(), None)
        except EOFError:
            return
        try:
            reply = (True, _resolve(fn)(*args))
        except Exception as exc:  # sent back and re-raised in the parent
            try:
                pickle.dumps(exc)
            except Exception:
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            reply = (False, exc)
        _send(stdout, reply)


if __name__ == "__main__":
    _serve()
