"""The expected wait before a new request's first token, from rates the engine measures as it runs.

A request waits for a batch slot, then for the prompt tokens ahead of it (and its own) to be
prefilled. With the batch full, slots free as running sequences finish: the batch produces
``decode_rate`` tokens/s and a sequence holds its slot for ``output_tokens`` tokens on average,
so one slot frees every ``output_tokens / decode_rate`` seconds. Prompt tokens go at
``prefill_rate`` tokens/s. Every figure is exponentially weighted over what the engine saw (per
step, per finished sequence; a rate as tokens over seconds, each weighted); before the first
measurement a prior stands in.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.1  # weight of the newest sample in each moving mean
MIN_PREFILL_SHARE = 0.25  # of a mixed step's time, the least counted as prefill (a noisy decode rate)


@dataclass
class _Mean:
    """An exponentially weighted mean; the first sample replaces the prior."""

    value: float
    measured: bool = False

    def add(self, sample: float) -> None:
        self.value = sample if not self.measured else self.value + ALPHA * (sample - self.value)
        self.measured = True


class _Rate:
    """Tokens per second as a ratio of two moving sums, so that a step feeding 3 tokens weighs
    3 tokens, not as much as one feeding 300 (a mean of per-step ratios is ruled by the small,
    overhead-bound steps)."""

    def __init__(self, prior: float) -> None:
        self._tokens = _Mean(prior)
        self._seconds = _Mean(1.0)

    @property
    def measured(self) -> bool:
        return self._tokens.measured

    @property
    def value(self) -> float:
        return self._tokens.value / self._seconds.value

    def add(self, tokens: float, seconds: float) -> None:
        self._tokens.add(tokens)
        self._seconds.add(seconds)


class QueueWait:
    """Moving rates of the engine and the wait they predict; O(1) per sample and per estimate.

    Written by the engine thread, read by request handlers: each rate is one float, replaced whole.
    """

    def __init__(self, *, prefill_rate: float = 1000.0, decode_rate: float = 50.0, output_tokens: float = 128.0,
                 prompt_tokens: float = 256.0, step_seconds: float = 0.05) -> None:
        self._prefill = _Rate(prefill_rate)  # prompt tokens per second
        self._decode = _Rate(decode_rate)  # tokens per second of the whole batch
        self._output = _Mean(output_tokens)  # tokens a sequence generates before it leaves the batch
        self._prompt = _Mean(prompt_tokens)  # prompt tokens of an admitted sequence
        self._step = _Mean(step_seconds)

    @property
    def prefill_rate(self) -> float:
        return self._prefill.value

    @property
    def decode_rate(self) -> float:
        return self._decode.value

    @property
    def output_tokens(self) -> float:
        return self._output.value

    @property
    def prompt_tokens(self) -> float:
        """Mean prompt length of admitted sequences (stands in for a prompt not yet rendered)."""
        return self._prompt.value

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """One engine step took ``seconds`` and fed ``prefill_tokens`` prompt (or extension)
        tokens and ``decode_tokens`` one-token decode rows."""
        if seconds <= 0 or prefill_tokens + decode_tokens == 0:
            return
        self._step.add(seconds)
        if not prefill_tokens:
            self._decode.add(decode_tokens, seconds)
            return
        # a mixed step: the decode rows' share of its time, at the pure-decode rate
        decode_part = decode_tokens / self._decode.value if self._decode.measured else 0.0
        self._prefill.add(prefill_tokens, max(seconds - decode_part, seconds * MIN_PREFILL_SHARE))

    def observe_finished(self, output_tokens: int) -> None:
        """A sequence left the batch after generating ``output_tokens`` tokens."""
        self._output.add(max(output_tokens, 1))

    def observe_admitted(self, prompt_tokens: int) -> None:
        """A sequence of ``prompt_tokens`` prompt tokens entered the batch."""
        self._prompt.add(max(prompt_tokens, 1))

    def estimate(self, ahead_seqs: int, ahead_tokens: float, running: int, batch_size: int,
                 own_tokens: float | None = None) -> float:
        """Seconds until the first token of a sequence queued behind ``ahead_seqs`` waiting
        sequences (``ahead_tokens`` prompt tokens) while ``running`` of ``batch_size`` slots are
        taken; ``own_tokens`` is its prompt (None: the mean prompt)."""
        own = self.prompt_tokens if own_tokens is None else own_tokens
        slots_needed = max(ahead_seqs + 1 - max(batch_size - running, 0), 0)
        slot_wait = slots_needed * self.slot_seconds()
        return slot_wait + (ahead_tokens + own) / self.prefill_rate + self._step.value

    def slot_seconds(self) -> float:
        """Seconds between two slots freeing in a full batch."""
        return self.output_tokens / self.decode_rate

    def per_sequence(self, batch_full: bool) -> float:
        """Seconds one more (mean) sequence in the queue adds to the wait of those behind it."""
        return (self.slot_seconds() if batch_full else 0.0) + self.prompt_tokens / self.prefill_rate
