"""Prompt lookup: a sequence's drafts found in its own context, with no draft model.

Extraction and tool-calling outputs copy spans of their prompt (names, numbers, quoted text),
and long outputs repeat themselves. After each token the longest recent n-gram of the context
(prompt + output so far, ``MAX_NGRAM`` down to ``MIN_NGRAM`` tokens) is looked up among its
earlier occurrences, and the tokens that followed the latest of them are the proposal. The
index is updated once per token (``MAX_NGRAM`` dictionary writes), so a proposal costs a few
lookups however long the prompt is.
"""

from __future__ import annotations

MAX_NGRAM = 4
MIN_NGRAM = 1


class PromptLookup:
    """The n-gram index of one sequence's context and the continuation its suffix points at."""

    def __init__(self, prompt: list[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.prompt_length = len(prompt)
        self._prompt_text: str | None = None
        self.context: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram → position right after its latest occurrence
        self._previous: list[int | None] = [None] * (max_ngram + 1)  # per n: where the suffix occurred before
        for token in prompt:
            self.observe(token)

    def observe(self, token: int) -> None:
        """The context gained ``token`` (prompt while building, then each output token)."""
        self.context.append(token)
        end = len(self.context)
        for n in range(self.min_ngram, self.max_ngram + 1):
            if n > end:
                self._previous[n] = None
                continue
            key = tuple(self.context[end - n : end])
            self._previous[n] = self._after.get(key)
            self._after[key] = end

    def proposal(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest suffix n-gram's latest earlier occurrence."""
        if limit <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            start = self._previous[n]
            if start is not None:
                return self.context[start : start + limit]
        return []

    def proposal_after(self, extra: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens expected after the context followed by ``extra`` (tokens not
        observed yet: a draft being composed), from the longest suffix n-gram found earlier."""
        if not extra:
            return self.proposal(limit)
        if limit <= 0:
            return []
        tail = self.context[-self.max_ngram :] + extra
        end = len(self.context)
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            start = self._after.get(tuple(tail[-n:]))
            if start is not None and start < end:
                return self.context[start : start + limit]
        return []

    def prompt_text(self, decode) -> str:
        """The prompt as text (``decode``d once)."""
        if self._prompt_text is None:
            self._prompt_text = decode(self.context[: self.prompt_length])
        return self._prompt_text
