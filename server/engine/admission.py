"""Admission control: a bound on the work waiting for a KV slot."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from server.engine.errors import EngineDead, EngineOverloaded

RATE_WINDOW_S = 60.0  # admissions older than this do not count towards the throughput estimate
MAX_RETRY_AFTER_S = 60


class AdmissionControl:
    """Thread-safe counters of sequences (and their prompt tokens) submitted but not yet running.

    A request is queued whole or refused whole. When nothing is waiting, a request is taken
    whatever its size, so a request larger than the limits is slow rather than never served.
    """

    def __init__(self, max_seqs: int, max_tokens: int) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._seqs = 0
        self._tokens = 0
        self._closed: str | None = None
        self._admitted: deque[tuple[float, int, int]] = deque(maxlen=512)  # (time, seqs, tokens)

    @property
    def waiting_seqs(self) -> int:
        return self._seqs

    @property
    def waiting_tokens(self) -> int:
        return self._tokens

    def check(self, seqs: int, tokens: int) -> None:
        """Raise as :meth:`reserve` would for ``seqs`` sequences of ``tokens`` prompt tokens, counting nothing."""
        with self._lock:
            self._refuse_if_over(seqs, tokens)

    def reserve(self, prompt_lengths: list[int], enqueue: Callable[[], None]) -> None:
        """Count the sequences and run ``enqueue`` under the lock, or raise without counting.

        Raises:
            EngineDead: after :meth:`close`.
            EngineOverloaded: the sequences or their prompt tokens do not fit.
        """
        seqs, tokens = len(prompt_lengths), sum(prompt_lengths)
        with self._lock:
            self._refuse_if_over(seqs, tokens)
            self._seqs += seqs
            self._tokens += tokens
            enqueue()

    def _refuse_if_over(self, seqs: int, tokens: int) -> None:
        if self._closed is not None:
            raise EngineDead(self._closed)
        seqs_over = self._seqs + seqs - self.max_seqs
        tokens_over = self._tokens + tokens - self.max_tokens
        if self._seqs and (seqs_over > 0 or tokens_over > 0):
            raise EngineOverloaded(
                f"server overloaded: {self._seqs} sequences ({self._tokens} prompt tokens) are waiting",
                self._retry_after(max(seqs_over, 0), max(tokens_over, 0)),
            )

    def admitted(self, prompt_lengths: list[int]) -> None:
        """Sequences entered the running batch (this is the throughput ``retry_after`` uses)."""
        if prompt_lengths:
            with self._lock:
                self._take(len(prompt_lengths), sum(prompt_lengths))
                self._admitted.append((time.monotonic(), len(prompt_lengths), sum(prompt_lengths)))

    def dropped(self, prompt_length: int) -> None:
        """A waiting sequence left without running (aborted or failed)."""
        with self._lock:
            self._take(1, prompt_length)

    def close(self, reason: str) -> None:
        """Refuse everything from now on with ``EngineDead(reason)``; nothing is waiting any more."""
        with self._lock:
            self._closed = reason
            self._seqs = self._tokens = 0

    def _take(self, seqs: int, tokens: int) -> None:
        self._seqs = max(self._seqs - seqs, 0)
        self._tokens = max(self._tokens - tokens, 0)

    def _retry_after(self, seqs_over: int, tokens_over: int) -> int:
        """Seconds until the recent admission rate would have made room (1 when unknown)."""
        now = time.monotonic()
        recent = [(t, s, n) for t, s, n in self._admitted if now - t <= RATE_WINDOW_S]
        if not recent:
            return 1
        span = max(now - recent[0][0], 1.0)
        seq_rate = sum(s for _, s, _ in recent) / span
        token_rate = sum(n for _, _, n in recent) / span
        wait = seqs_over / seq_rate
        if tokens_over:
            wait = max(wait, tokens_over / token_rate if token_rate else MAX_RETRY_AFTER_S)
        return min(max(math.ceil(wait), 1), MAX_RETRY_AFTER_S)
