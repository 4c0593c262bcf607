"""When the overlapped loop launches before reading, and when it reads first: measured, per step.

The overlapped order (launch step N+1's forward, then read step N's tokens, then fill N+1's
masks) hides the host's token processing behind the forward, but the mask fill must wait for the
tokens. The synchronous order (read N's tokens, then launch N+1 and fill its masks on the mask
thread while the device computes) hides the fill instead. Both give the same output, so the
order may change from one step to the next: the policy keeps moving averages of the forward's
device time and of the mask fill's time, and reads first while the fill is the longer one
(many constrained rows on a fast device, a slow grammar).
"""

from __future__ import annotations

SMOOTHING = 0.3  # weight of the newest measurement in the moving averages


class OverlapPolicy:
    """``enabled``: the overlapped order is allowed at all (``--overlap``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.forward_ms: float | None = None  # device time of a forward (None: not measured yet)
        self.fill_ms = 0.0  # mask fill time of a step (0 for steps without host masks)

    def record_forward(self, ms: float | None) -> None:
        if ms is not None:
            self.forward_ms = ms if self.forward_ms is None else _smooth(self.forward_ms, ms)

    def record_fill(self, ms: float) -> None:
        self.fill_ms = _smooth(self.fill_ms, ms)

    @property
    def launch_first(self) -> bool:
        """Launch the next forward before reading the tokens in flight."""
        return self.enabled and (self.forward_ms is None or self.fill_ms <= self.forward_ms)


def _smooth(average: float, value: float) -> float:
    return (1 - SMOOTHING) * average + SMOOTHING * value
