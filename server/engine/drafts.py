"""Predicted outputs: the draft a sequence verifies, and where the output stands in it.

A prediction (OpenAI's ``prediction: {"type": "content", ...}``) is tokenized once into a draft.
While the output follows the draft, the engine feeds the next draft tokens after the last sampled
token as one extension and keeps the longest prefix that sampling agrees with. When the output
leaves the draft (a rejected token, a forced token that differs), the draft is re-aligned cheaply:
the last :data:`ALIGN_NGRAM` output tokens are looked up in an n-gram index of the draft, and
proposals resume right after the first occurrence at or after the current position (so an edit
in the middle of a predicted file costs a few unverified tokens, not the rest of the draft).
"""

from __future__ import annotations

from collections import deque

ALIGN_NGRAM = 3


class Draft:
    """Draft tokens of one sequence, the position the output has reached, and the counters."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.position = 0  # the next draft token the output is expected to produce
        self.aligned = True
        self.accepted = 0  # draft tokens verified by sampling and used in the output
        self.rejected = 0  # draft tokens fed for verification and not used
        self._recent: deque[int] = deque(maxlen=ALIGN_NGRAM)
        self._index: dict[tuple[int, ...], list[int]] | None = None

    def proposal(self, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens expected next (none while the output is off the draft)."""
        if not self.aligned or limit <= 0:
            return []
        return self.tokens[self.position : self.position + limit]

    def observe(self, token: int) -> None:
        """The output gained ``token``: advance along the draft, or re-align after a divergence."""
        self._recent.append(token)
        if self.aligned and self.position < len(self.tokens) and self.tokens[self.position] == token:
            self.position += 1
            return
        self.aligned = False
        self._realign()

    def settle(self, fed: int, used: int) -> None:
        """One verification fed ``fed`` draft tokens, of which the first ``used`` were kept."""
        self.accepted += used
        self.rejected += fed - used

    def _realign(self) -> None:
        if len(self._recent) < ALIGN_NGRAM:
            return
        ends = self._ngram_index().get(tuple(self._recent), ())
        later = [end for end in ends if end >= self.position]
        if later:
            self.position = later[0]
            self.aligned = True

    def _ngram_index(self) -> dict[tuple[int, ...], list[int]]:
        """n-gram → the draft positions right after each of its occurrences (built once)."""
        if self._index is None:
            self._index = {}
            for end in range(ALIGN_NGRAM, len(self.tokens) + 1):
                self._index.setdefault(tuple(self.tokens[end - ALIGN_NGRAM : end]), []).append(end)
        return self._index
