"""Whether draft tokens pay for themselves at the current step size, from measured forward cost.

A step feeding ``n`` tokens costs about ``a + b·n`` (the weights read once, then per-token work).
Adding ``d`` draft tokens of which ``A`` are kept turns ``n`` tokens per step into ``n + A``,
at a cost of ``(b + v)·d`` more, ``v`` the host time verification spends per draft token (its
sampler passes and mask fills, measured every step): worth it when
``A / d > (b + v)·n / (a + b·n)``. ``a`` and ``b`` are fitted
to every forward's (tokens, time) by least squares with exponential forgetting, so the
threshold follows the machine and the load: near zero for one sequence whose step time is the
weight read, close to one when the batch already makes the step compute-bound. Until the fit
has seen steps of different sizes, drafts are let through (that is how it sees them). A draft
source kept less than ``MIN_ACCEPTANCE`` of the time is priced out whatever the fit says.
"""

from __future__ import annotations

DECAY = 0.98  # weight of the past per recorded forward
MIN_SPREAD = 1.0  # tokens²: below this variance of the step sizes the slope is not trusted
# Verifying a draft also costs what the forward fit does not see: logits at every draft position
# and a sampler pass per kept position. Drafts kept less often than this never pay for that
# (free text: prompt lookup keeps well under one token in ten).
MIN_ACCEPTANCE = 0.2


VERIFY_WEIGHT = 0.1  # weight of the newest step in the verification cost estimate


class SpeculationPolicy:
    """The fitted step cost and the acceptance a draft token needs (see the module docstring)."""

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weighted n, x, y, xx, xy
        self.verify_s_per_token = 0.0  # host seconds the verification spends per draft token fed
        self._last: tuple[int, float] | None = None  # (tokens, threshold): every row of a step asks alike

    def record_verification(self, draft_tokens: int, seconds: float) -> None:
        """One step's drafts took ``seconds`` of host time for ``draft_tokens`` fed: composing
        them, then verifying them (a sampler pass and a mask fill per kept position, the rollback)."""
        if draft_tokens > 0:
            self.verify_s_per_token += VERIFY_WEIGHT * (seconds / draft_tokens - self.verify_s_per_token)
            self._last = None

    def record_launched(self, tokens: int, device_s: float, launch_s: float) -> None:
        """A forward timed on an asynchronous device: it costs the longer of its device time and
        the host's time to launch it. A step of full graphs launches in microseconds, but a mixed
        step (drafts, forced tokens) replays piecewise graphs a layer at a time, and when that
        launch outlasts the device's work the device waits on the host: its events show only the
        work, so the fit would price drafts as nearly free on a card that is mostly idle."""
        self.record(tokens, max(device_s, launch_s))

    def record(self, tokens: int, seconds: float) -> None:
        """One forward fed ``tokens`` tokens and took ``seconds`` (its cost to the step)."""
        if tokens <= 0 or seconds <= 0:
            return
        x, y = float(tokens), float(seconds)
        sums = [value * DECAY for value in self._sums]
        for i, term in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] += term
        self._sums = sums
        self._last = None

    def cost(self) -> tuple[float, float] | None:
        """(a, b): fixed and per-token seconds of a forward, or None until the slope is known."""
        n, x, y, xx, xy = self._sums
        if n <= 0:
            return None
        spread = xx / n - (x / n) ** 2
        if spread < MIN_SPREAD:
            return None
        slope = (xy / n - (x / n) * (y / n)) / spread
        fixed = y / n - slope * (x / n)
        return max(fixed, 0.0), max(slope, 0.0)

    def threshold(self, tokens: int) -> float:
        """The share of draft tokens that must be kept for drafting to pay in a step of ``tokens``."""
        if self._last is None or self._last[0] != tokens:
            self._last = (tokens, self._threshold(tokens))
        return self._last[1]

    def _threshold(self, tokens: int) -> float:
        cost = self.cost()
        if cost is None:
            return 0.0
        fixed, slope = cost
        total = fixed + slope * tokens
        return (slope + self.verify_s_per_token) * tokens / total if total > 0 else 0.0

    def worth(self, acceptance: float, tokens: int) -> bool:
        """Drafts with this expected acceptance pay in a step of ``tokens`` tokens."""
        return acceptance > max(self.threshold(tokens), MIN_ACCEPTANCE)
