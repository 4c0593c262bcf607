"""Memory that stays flat: freed heap given back to the OS once the server idles, and caches of
text derived from requests bounded in bytes.

glibc's malloc keeps what Python, the tokenizer and the constraint libraries free in its arenas,
resident, for reuse: after 1,000 hostile requests (``benchmarks/memory.py``) about 450 MiB of the
server's heap was free but still resident, and stayed so. ``malloc_trim(0)`` returns it. Trimming
while sequences run would be undone by the next steps, so :class:`IdleTrimmer` trims only after
the engine has been idle for a while, and only when resident memory grew since the last trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("trellis")

T = TypeVar("T")
MIN_GROWTH_BYTES = 16 << 20  # less than this since the last trim: not worth walking the heap


def libc_malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``), 0 where unreadable."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class IdleTrimmer:
    """A daemon thread that calls ``trim`` once ``busy()`` has been false for ``idle_s`` seconds
    and resident memory grew by ``min_growth`` bytes since the last trim (or the start)."""

    def __init__(self, busy: Callable[[], bool], idle_s: float, *, trim: Callable[[], object] | None = None,
                 rss: Callable[[], int] = resident_bytes, min_growth: int = MIN_GROWTH_BYTES) -> None:
        self.idle_s = idle_s
        self.trims = 0
        self._busy = busy
        self._trim = trim
        self._rss = rss
        self._min_growth = min_growth
        self._floor = rss()  # resident memory after the last trim
        self._idle_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (a no-op when ``idle_s`` is 0 or there is nothing to trim with)."""
        if self.idle_s <= 0 or self._trim is None:
            return
        self._thread = threading.Thread(target=self._run, name="trellis-memory-trim", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check(self, now: float | None = None) -> bool:
        """One look: trims when due; whether it trimmed."""
        now = time.monotonic() if now is None else now
        if self._busy():
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.idle_s or self._rss() < self._floor + self._min_growth:
            return False
        before = self._rss()
        self._trim()
        self._floor = self._rss()
        self.trims += 1
        log.debug("memory trim: resident %d -> %d MiB", before >> 20, self._floor >> 20)
        return True

    def _run(self) -> None:
        poll = min(1.0, self.idle_s / 2)
        while not self._stop.wait(poll):
            try:
                self.check()
            except Exception:  # a failed look must not end the watch
                log.exception("memory trim failed")


class TextCache:
    """A thread-safe LRU of results computed from request text (tool schemas, chat templates),
    bounded in bytes: each entry counts its string arguments and result (other values count
    :data:`OBJECT_BYTES`). Client text can be megabytes, so a bound by count is no bound."""

    OBJECT_BYTES = 256

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` (positional, hashable arguments) with its results kept here."""

        @functools.wraps(fn)
        def wrapper(*args):
            key = (fn.__qualname__, *args)
            with self._lock:
                hit = self._items.get(key)
                if hit is not None:
                    self._items.move_to_end(key)
                    return hit[0]
            value = fn(*args)
            self.put(key, value, sum(map(_size, args)) + _size(value))
            return value

        return wrapper

    def put(self, key: tuple, value: object, size: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def _size(value: object) -> int:
    return sys.getsizeof(value) if isinstance(value, (str, bytes)) else TextCache.OBJECT_BYTES


# grammars and template facts derived from request text; sized by --text-cache-mb at startup
DERIVED_TEXT = TextCache(32 << 20)
