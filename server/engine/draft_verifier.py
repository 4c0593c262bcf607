"""Drafts verified inside the batched step (predicted outputs, prompt lookup), output unchanged.

A row whose :class:`~server.engine.speculation.Speculator` proposes tokens feeds them after its
pending tokens (``seq.verify``), as one extension sharing the step's prefill budget, and gets
logits at every fed position. A constrained row's draft is first cut at the first token its
matcher refuses (it could never be sampled), and drafts are fed only while the measured step
cost says their expected acceptance pays for them (:mod:`server.engine.speculation_policy`). After the step's sampling, the positions after each draft token are
sampled in rounds, one batched sampler pass per position over the rows still agreeing; a draft
token counts only if the token sampled there equals it, and the cache is rolled back past the
first disagreement. Each position is sampled exactly as without a draft (same processing, same
RNG stream), so the output is the one the row would produce without a prediction.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.speculation_policy import SpeculationPolicy

Extension = list[tuple[Sequence, int]]  # (sequence, tokens fed)


class DraftVerifier:
    """Gives rows their drafts before the forward and keeps what sampling agrees with after it."""

    def __init__(self, scheduler: Scheduler, stats, *, prefill_budget: int, max_draft_tokens: int,
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.prefill_budget = prefill_budget
        self.max_draft_tokens = max_draft_tokens
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy()
        self._proposing_s = 0.0  # host time this step's drafts took to propose (priced with verification)

    def wants_tokens_first(self, running: list[Sequence]) -> bool:
        """Some row may draft this step: its proposal continues from its last token, so the loop
        reads the tokens in flight before scheduling."""
        drafting = [seq for seq in running if seq.draft is not None and seq.draft.ready]
        return any(self.policy.worth(seq.draft.acceptance, len(running)) for seq in drafting)

    def plan(self, decode_rows: list[Sequence], extend_plan: Extension) -> tuple[list[Sequence], Extension]:
        """Give rows that follow a prediction their next draft tokens (``seq.verify``), fed after
        their pending tokens; a decoding row with a draft becomes a one-token extension."""
        fed = sum(take for _, take in extend_plan)
        budget = self.prefill_budget - fed
        step_tokens = len(decode_rows) + fed
        for seq, take in [(seq, 1) for seq in decode_rows] + extend_plan:
            if seq.draft is None or take != len(seq.pending) or seq.scoring or budget <= 0:
                continue
            # a client's prediction is verified as asked; the engine's own drafts only where they pay
            if not seq.draft.following_prediction and not self.policy.worth(seq.draft.acceptance, step_tokens):
                seq.draft.priced_out()
                continue
            started = time.perf_counter()
            draft = self._proposal(seq, self._room(seq, budget))
            # a lookup draft was composed token by token with the matcher: cutting it again is waste
            seq.verify = draft if seq.draft.source == "prompt" else self._grammar_cut(seq, draft)
            self._proposing_s += time.perf_counter() - started
            if seq.verify and not self.scheduler.grow(seq, seq.cached_len + take + len(seq.verify)):
                seq.verify = []  # no free block for the draft: plain decoding this step
            budget -= len(seq.verify)
        if not any(seq.verify for seq in decode_rows):
            return decode_rows, extend_plan
        drafting = [(seq, 1) for seq in decode_rows if seq.verify]
        return [seq for seq in decode_rows if not seq.verify], extend_plan + drafting

    @staticmethod
    def _proposal(seq: Sequence, room: int) -> list[int]:
        """The row's next draft; a lookup draft of a constrained row is composed with its
        grammar (a failing matcher drafts nothing; the mask fill reports its failure)."""
        try:
            return seq.draft.proposal(room, seq.matcher)
        except Exception:
            return []

    @staticmethod
    def _grammar_cut(seq: Sequence, draft: list[int]) -> list[int]:
        """``draft`` up to the first token the row's constraint refuses (all of it when free)."""
        matcher = seq.matcher
        if not draft or matcher is None:
            return draft
        try:
            return draft[: _valid_prefix(matcher, draft)]
        except Exception:  # a failing matcher drafts nothing; the mask fill reports its failure
            return []

    def _room(self, seq: Sequence, budget: int) -> int:
        """How many draft tokens ``seq`` may verify now: the per-step cap, the budget, the
        tokens it may still emit (one is the token sampled after the draft) and the cache."""
        emitted = len(seq.request.prompt_token_ids) + len(seq.output_ids)
        return min(
            self.max_draft_tokens,
            budget,
            seq.request.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - emitted - 1,
        )

    def verify(self, drafting: list[tuple[Sequence, int]],
               sample_position: Callable[[list[tuple[Sequence, int]]], None]) -> None:
        """Sample the positions after each fed draft token in rounds, then roll the cache back
        past the first disagreement. ``drafting``: (sequence, its output length before this
        step's sampling), with this step's tokens already taken; ``sample_position(rows)``
        samples and takes, for each (sequence, i), the token after its draft token ``i``.

        A kept draft token may be followed by tokens the grammar forces (jump-forward appends
        them): those equal to the draft's next tokens are already cached and kept too, and
        sampling resumes after them."""
        if not drafting:
            self._proposing_s = 0.0
            return
        started = time.perf_counter() - self._proposing_s
        self._proposing_s = 0.0
        fed = sum(len(seq.verify) for seq, _ in drafting)
        used = {id(seq): 0 for seq, _ in drafting}
        active = [(seq, mark, 0) for seq, mark in drafting]
        while active:
            to_sample = []
            for seq, mark, position in active:
                position = _keep_agreeing(seq, mark, position, used)
                if position is not None:
                    to_sample.append((seq, mark, position))
            if to_sample:
                sample_position([(seq, position) for seq, _, position in to_sample])
            active = [(seq, mark, position + 1) for seq, mark, position in to_sample]
        for seq, _ in drafting:
            kept = used[id(seq)]
            seq.table.truncate(seq.cached_len - (len(seq.verify) - kept))
            if seq.draft.source == "prompt":
                self.stats.lookup_draft_tokens += len(seq.verify)
                self.stats.accepted_lookup_draft_tokens += kept
            seq.draft.settle(len(seq.verify), kept)
            self.stats.draft_tokens += len(seq.verify)
            self.stats.accepted_draft_tokens += kept
            seq.verify, seq.verify_logits = [], None
        self.policy.record_verification(fed, time.perf_counter() - started)


def _keep_agreeing(seq: Sequence, mark: int, position: int, used: dict[int, int]) -> int | None:
    """Keep the draft tokens from ``position`` on that the output agrees with (the one sampled
    there, then any forced after it); returns the position whose next token is to be sampled,
    or None when the row is done (a disagreement, the end of its draft, or it finished)."""
    while _sampled_draft_token(seq, mark, position):
        used[id(seq)] = position + 1
        if seq.finished:
            return None
        seq.pending.pop(0)  # the draft token's keys/values are already cached
        if not seq.pending:  # nothing forced after it: sample the next position
            return position
        position += 1  # a forced token follows: kept if it is the draft's next token
    return None


def _sampled_draft_token(seq: Sequence, mark: int, position: int) -> bool:
    """This step's output token ``position`` (counted from output length ``mark``) exists and is
    the draft token fed at that position."""
    out = seq.output_ids
    index = mark + position
    return position < len(seq.verify) and len(out) > index and out[index] == seq.verify[position]


def _valid_prefix(matcher, draft: list[int]) -> int:
    """How many draft tokens the matcher takes from its current state, which it keeps (its own
    ``valid_prefix`` where it has one)."""
    valid_prefix = getattr(matcher, "valid_prefix", None)
    if valid_prefix is not None:
        return valid_prefix(draft)
    if getattr(matcher, "rollback", None) is None:  # cannot probe without consuming: sampling decides
        return len(draft)
    taken = 0
    while taken < len(draft) and matcher.accept_token(draft[taken]):
        taken += 1
    matcher.rollback(taken)
    return taken
