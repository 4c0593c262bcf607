"""Free to think, strict to answer: a sequence's reasoning segment before its constraint.

While a sequence is inside its reasoning segment (``seq.reasoning``) its constraint is not
consulted: no mask, no acceptance, no jump-forward, no termination. The segment ends when the
output ends with the end marker (its ids, or its text written in other tokens), or is ended by
the gate (the marker forced) once the reasoning budget is spent or when the model samples EOS
while an answer is still owed. Then the answer's prefix is forced and the constraint starts
fresh on the tokens that follow.
"""

from __future__ import annotations

from collections.abc import Callable

from sampler import TokenLogprobs
from server.engine.failures import guarded
from server.engine.inflight import unfeed
from server.engine.sequence import ReasoningPhase, Sequence


class ReasoningGate:
    """Moves sequences through their reasoning segment into their constraint.

    ``append(seq, token, logprob)`` and ``force(seq, tokens)`` add tokens to a sequence (True:
    it finished); ``constrain(seq)`` is called when the constraint takes over."""

    def __init__(self, tokenizer, append: Callable, force: Callable, constrain: Callable[[Sequence], None]) -> None:
        self.tokenizer = tokenizer
        self._append = append
        self._force = force
        self._constrain = constrain

    def enter(self, seq: Sequence) -> None:
        """A new sequence starts inside its reasoning segment: open it where the prompt did not."""
        phase = seq.reasoning
        seq.reasoning = None  # forced markers are not reasoning tokens
        if self._force(seq, phase.start_ids):
            return
        seq.reasoning = phase
        if phase.budget == 0:
            self.end(seq, force_end=True)

    def take(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        """A token sampled inside the reasoning segment (``fed``: the overlapped loop fed it)."""
        request = seq.request
        if request.matcher is not None and token in request.eos_token_ids and not request.ignore_eos:
            unfeed(seq, token, fed)  # the answer is still owed: end the reasoning instead of the sequence
            self.end(seq, force_end=True)
            return
        if self._append(seq, token, logprob):
            return
        phase = seq.reasoning
        if seq.output_ids[-len(phase.end_ids):] == list(phase.end_ids) or self._wrote_end_text(seq, phase):
            self.end(seq, force_end=False)
            return
        seq.reasoning_tokens += 1
        if phase.budget is not None and seq.reasoning_tokens >= phase.budget:
            self.end(seq, force_end=True)

    def end(self, seq: Sequence, *, force_end: bool) -> None:
        """Leave the segment (forcing its end marker when the model did not write it), force the
        answer's prefix, then hand the sequence to its constraint, fresh from its first state."""
        phase, seq.reasoning = seq.reasoning, None
        forced = (phase.end_ids if force_end else ()) + phase.answer_prefix_ids
        if self._force(seq, forced):
            return
        request = seq.request
        seq.matcher = request.matcher
        if request.token_dfa is not None:
            seq.row.attach_dfa(request.token_dfa)
        self._constrain(seq)

    def _wrote_end_text(self, seq: Sequence, phase: ReasoningPhase) -> bool:
        """Whether the last token completed the end marker's text (a marker split over tokens,
        whichever tokens the model wrote it in). Every token decodes to at least one character,
        so the marker lies within the last ``len(end_text)`` tokens."""
        if not phase.end_text:
            return False
        window = seq.output_ids[-len(phase.end_text) - 1 :]

        def text(ids: list[int]) -> str:
            return guarded("detokenizer", lambda: self.tokenizer.decode(ids, skip_special_tokens=False)) or ""

        return phase.end_text in text(window) and phase.end_text not in text(window[:-1])
