"""Where every token enters a sequence: sampled, forced, steered or scored.

:meth:`TokenIntake.take_sampled` is the one entry for a sampled token: the reasoning gate or the
constraint (with close_on_length's steering) accepts it, :meth:`TokenIntake.append` adds it to
the output (detokenizer, stop strings and tokens, EOS, the budget and the context end), and
jump-forward appends the tokens the constraint then forces, to be fed with the next forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sampler import TokenLogprobs
from server.engine.closing import accept_closing, closes_on_length
from server.engine.failures import CONSTRAINT_LIMIT, SequenceFailed, describe, guarded
from server.engine.inflight import unfeed
from server.engine.reasoning_gate import ReasoningGate
from server.engine.sequence import Sequence

log = logging.getLogger("trellis.engine")


class TokenIntake:
    """Takes tokens into sequences. ``fail(seq, message, replace_finish=...)`` ends one
    sequence with an error; ``stats`` counts forced and steered tokens."""

    def __init__(self, tokenizer, *, max_model_len: int, jump_forward: bool, stats, fail: Callable) -> None:
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward
        self.stats = stats
        self._fail = fail
        self.reasoning = ReasoningGate(tokenizer, self.append, self.force, self._constrained)

    def take_sampled(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        """Take a sampled token into ``seq`` (``fed``: the overlapped loop already fed it to the
        model); whatever fails ends only this sequence."""
        if seq.finished:
            return
        try:
            self._take(seq, token, logprob, fed)
        except SequenceFailed as exc:  # its output of this step is incomplete, whatever it finished with
            self._fail(seq, str(exc), replace_finish=True)
        except Exception as exc:
            log.exception("sequence of %s failed", seq.request.request_id)
            self._fail(seq, f"internal error: {describe(exc)}", replace_finish=True)

    def _take(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        if seq.reasoning is not None:
            self.reasoning.take(seq, token, logprob, fed)
            return
        matcher = seq.matcher
        sampled = token
        if closes_on_length(matcher):
            token, steered = accept_closing(seq, token, self.room(seq))
            if steered:
                self.stats.closing_steered += 1
                logprob = forced_logprob(seq, token)
        elif matcher is not None and not guarded("constraint matcher", matcher.accept_token, token):
            token = -1
        if token < 0:
            self._fail(seq, f"constraint rejected sampled token {sampled}")
            return
        if matcher is not None and getattr(matcher, "error", None):  # a parser limit: not a real stop
            raise SequenceFailed(f"{CONSTRAINT_LIMIT}: {matcher.error}")
        if self.append(seq, token, logprob):
            return
        if token != sampled:  # steered (close_on_length): the model is fed what was taken
            unfeed(seq, sampled, fed)
            seq.pending.insert(0, token)
        # Forced tokens come from no forward, so they would have no hidden state of their own.
        if matcher is not None and self.jump_forward and not seq.request.return_hidden_states:
            self.jump(seq)

    def jump(self, seq: Sequence) -> None:
        """Append the tokens the automaton forces; they are fed to the model in one extension."""
        matcher = seq.matcher
        room = seq.request.max_tokens - len(seq.output_ids)
        forced = guarded("constraint matcher", matcher.forced_tokens)[: max(room - 1, 0)]
        if not closes_on_length(matcher):
            taken = guarded("constraint matcher", _accept_forced, matcher, forced)
            self.force(seq, tuple(forced[:taken]))
            return
        for token in forced:  # close_on_length checks each against the budget, and may steer
            taken, steered = accept_closing(seq, token, self.room(seq))
            self.stats.closing_steered += steered
            if taken < 0:
                break
            self.stats.forced_tokens += 1
            if self.append(seq, taken, forced_logprob(seq, taken)):
                return
            seq.pending.append(taken)
            if steered:  # steered off the forced text: the rest no longer follows
                return

    def force(self, seq: Sequence, tokens: tuple[int, ...]) -> bool:
        """Append ``tokens`` unsampled (fed to the model with the next extension); True when the
        sequence finished on one of them."""
        for token in tokens:
            self.stats.forced_tokens += 1
            if self.append(seq, token, forced_logprob(seq, token)):
                return True
            seq.pending.append(token)
        return False

    def append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> bool:
        """Add one token to the output; returns True when it finished the sequence."""
        request = seq.request
        if seq.draft is not None:
            seq.draft.observe(token)
        seq.output_ids.append(token)
        seq.row.append_token(token)
        seq.step_tokens.append(token)
        if logprob is not None:
            seq.step_logprobs.append(logprob)
        matcher = seq.matcher
        if token in request.stop_token_ids:
            seq.finish("stop", token)
        elif token in request.eos_token_ids and not request.ignore_eos:
            seq.finish("stop")
            seq.eos_hit = token
        elif matcher is not None and guarded("constraint matcher", matcher.is_terminated):
            seq.finish("stop")
            seq.eos_hit = token if token in request.eos_token_ids else None
        if seq.finished:
            self.flush_text(seq)
            return True
        text, hit = _feed_stops(seq, guarded("detokenizer", seq.detokenizer.push, [token]))
        seq.step_text.append(text)
        if hit is not None:
            seq.finish("stop", hit)
        elif len(seq.output_ids) >= request.max_tokens or self._at_context_limit(seq):
            self.flush_text(seq)
            seq.finish("length")
        return seq.finished

    def flush_text(self, seq: Sequence) -> None:
        """The detokenizer's held-back text, through the stop strings, into this step's text."""
        seq.step_text.append(_feed_stops(seq, guarded("detokenizer", seq.detokenizer.flush))[0])

    def room(self, seq: Sequence) -> int:
        """Tokens the sequence may still add before its budget or the context ends it."""
        used = len(seq.output_ids)
        return min(seq.request.max_tokens - used, self.max_model_len - len(seq.request.prompt_token_ids) - used)

    def _at_context_limit(self, seq: Sequence) -> bool:
        return len(seq.request.prompt_token_ids) + len(seq.output_ids) >= self.max_model_len

    def _constrained(self, seq: Sequence) -> None:
        """The constraint just took over (after reasoning): it may force tokens at once."""
        if seq.matcher is not None and self.jump_forward:
            self.jump(seq)


def forced_logprob(seq: Sequence, token: int) -> TokenLogprobs:
    """The logprob entry of a token appended without sampling (certain: 0.0)."""
    return TokenLogprobs(token, 0.0, [(token, 0.0)] * bool(seq.request.params.top_logprobs))


def _accept_forced(matcher, forced: list[int]) -> int:
    """How many of ``forced`` the matcher took (its own ``accept_forced`` where it has one)."""
    accept_forced = getattr(matcher, "accept_forced", None)
    if accept_forced is not None:
        return accept_forced(forced)
    taken = 0
    while taken < len(forced) and matcher.accept_token(forced[taken]):
        taken += 1
    return taken


def _feed_stops(seq: Sequence, text: str) -> tuple[str, str | None]:
    return guarded("stop-string matching", seq.stops.feed, text)
