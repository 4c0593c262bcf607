"""Admission control: a bound on the work waiting for a KV slot, and on the wait it means.

:class:`AdmissionControl` counts what waits (and, through its :class:`QueueWait`, the rates the
engine runs at); :class:`WaitAdmission` refuses a request whose expected wait before its first
token is over the server's limit, before anything of it is rendered or compiled.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from server.engine.errors import EngineDead, EngineOverloaded
from server.engine.queue_wait import QueueWait

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
        self.rates = QueueWait()
        self._fed = (0, 0)  # the engine's (extend, decode) token totals at the last step

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
            for length in prompt_lengths:
                self.rates.observe_admitted(length)

    def stepped(self, seconds: float, stats) -> None:
        """An engine step took ``seconds``; ``stats`` (EngineStats) has the tokens it fed so far."""
        extend, decode = stats.extend_tokens, stats.decode_tokens
        self.rates.observe_step(seconds, extend - self._fed[0], decode - self._fed[1])
        self._fed = (extend, decode)

    def finished(self, output_tokens: int) -> None:
        """A sequence left the running batch after ``output_tokens`` tokens."""
        self.rates.observe_finished(output_tokens)

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


TIER_FACTORS = {"priority": 2.0, "flex": 0.5}  # of --max-queue-wait; other tiers wait the limit itself
# a request this early for a return takes it up: returners come after their time, and a wider
# window would let newcomers take returns before their returners get there
RETURN_EARLY_S = 0.05
RETURN_GRACE_S = 2.0  # a return not taken up this long after its time is forgotten
MAX_RETURNS = 4096
# the longest Retry-After by expected wait: under a steady overload the honest answer can be
# minutes (every client ahead gets its turn), and one cut short sends a herd back at the cap
MAX_RETURN_S = 300
# a return may wait this much over its limit: the estimate moves between the refusal and the
# return, and a client that came back when told should rarely be sent away again
RETURN_TOLERANCE = 1.25


class QueueWaitExceeded(EngineOverloaded):
    """The expected wait before the first token is over the limit (``estimate`` > ``limit`` s)."""

    def __init__(self, estimate: float, limit: float, tier: str, retry_after: int) -> None:
        super().__init__(f"the expected wait for a first token is {estimate:.1f} s, over this server's limit of "
                         f"{limit:g} s (service_tier {tier})", retry_after)
        self.estimate = estimate
        self.limit = limit


class Ticket:
    """A request let in but not yet submitted: it counts as one waiting sequence of the mean
    prompt length until :meth:`release` (idempotent), called when it is submitted or fails."""

    def __init__(self, gate: WaitAdmission | None) -> None:
        self._gate = gate

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.released()


class WaitAdmission:
    """Lets a request in only while its expected wait for a first token is within the limit
    (``limit_s`` times its tier's factor; 0 = no limit), and tells a refused one when to return.

    Refused requests are told to return in turn, one :meth:`QueueWait.per_sequence` apart, from
    when the queue would have drained below the limit. Until a return is due, its place is kept:
    a newcomer that would push a due return over the limit is refused and sent behind it. Each
    request is O(1): counters, moving rates, and a deque of return times popped from the front.
    Used from one thread (the event loop).
    """

    def __init__(self, control: AdmissionControl, limit_s: float, batch_size: int,
                 running: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.control = control
        self.limit_s = limit_s
        self.batch_size = batch_size
        self._running = running
        self._clock = clock
        self._pending = 0  # tickets out
        self._returns: deque[float] = deque()  # Retry-After times given, ascending

    @property
    def pending(self) -> int:
        """Requests let in and not yet submitted."""
        return self._pending

    def released(self) -> None:
        """A ticket was released: its request was submitted, or ended before (see :class:`Ticket`)."""
        self._pending -= 1

    def expected_wait(self, own_tokens: float | None = None) -> float:
        """Seconds before the first token of a request arriving now, behind every waiting
        sequence and every request let in but not yet submitted."""
        return self._estimate(self._running(), own_tokens)

    def enter(self, tier: str | None) -> Ticket:
        """A ticket for a request of ``tier``, or QueueWaitExceeded with its ``retry_after``."""
        if self.limit_s <= 0:
            return Ticket(None)
        now = self._clock()
        running = self._running()
        idle = not (running or self.control.waiting_seqs or self._pending)
        if idle:  # no queue to keep places in: returns still out find room whenever they come
            self._returns.clear()
        returning = self._take_return(now)
        # nothing waiting and a slot free: taken whatever the estimate (refusing would not help it)
        if self.control.waiting_seqs + self._pending or running >= self.batch_size:
            tier = tier or "default"
            limit = self.limit_s * TIER_FACTORS.get(tier, 1.0) * (RETURN_TOLERANCE if returning else 1.0)
            wait = self._estimate(running, None)
            step = self.control.rates.per_sequence(batch_full=True)
            if wait > limit or not self._keeps_returns(wait + step, limit, now):
                raise QueueWaitExceeded(wait, limit, tier, self._book_return(wait, limit, step, now))
        self._pending += 1
        return Ticket(self)

    def _estimate(self, running: int, own_tokens: float | None) -> float:
        rates = self.control.rates
        ahead_seqs = self.control.waiting_seqs + self._pending
        ahead_tokens = self.control.waiting_tokens + self._pending * rates.prompt_tokens
        return rates.estimate(ahead_seqs, ahead_tokens, running, self.batch_size, own_tokens)

    def _take_return(self, now: float) -> bool:
        """Forget returns long overdue; a request arriving when one is due is taken as it (True)."""
        returns = self._returns
        while returns and returns[0] < now - RETURN_GRACE_S:
            returns.popleft()
        if returns and returns[0] <= now + RETURN_EARLY_S:
            returns.popleft()
            return True
        return False

    def _keeps_returns(self, wait_behind: float, limit: float, now: float) -> bool:
        """Whether the next return, when it comes, still waits within the limit with this
        request ahead of it (the queue drains by a second a second until then)."""
        return not self._returns or wait_behind - (self._returns[0] - now) <= limit

    def _book_return(self, wait: float, limit: float, step: float, now: float) -> int:
        """Whole seconds until the queue has room for this request after every earlier return."""
        due = now + max(wait - limit, 0.0)
        if self._returns:
            due = max(due, self._returns[-1] + step)
        retry_after = max(math.ceil(due - now), 1)
        if retry_after > MAX_RETURN_S:  # not booked: a return this far off is as good as a new request
            return MAX_RETURN_S
        if len(self._returns) < MAX_RETURNS:
            self._returns.append(now + retry_after)
        return retry_after
