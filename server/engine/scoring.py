"""Choice scoring: every choice of a ``guided_choice`` request scored as a whole, one emitted.

A scoring sequence holds back its prompt's last token; once the rest of the prompt is cached,
each unscored choice runs in a branch of the sequence's blocks (full blocks shared, the last one
copied) fed ``[last prompt token, *choice]``, all in the step's one forward. A choice's score is
the sum of its tokens' logprobs under the raw model; when every choice is scored, one is picked
(greedy: the most probable; sampling: one draw at the row's temperature from its seeded RNG) and
its tokens are emitted through the constraint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sampler import TokenLogprobs
from sampler.pool import to_device
from server.engine.block_manager import BlockManager, BlockTable
from server.engine.failures import SequenceFailed, guarded
from server.engine.intake import TokenIntake
from server.engine.sequence import ChoiceScores, Sequence

Plan = list[tuple[Sequence, list[tuple[int, BlockTable]]]]  # (sequence, [(choice, branch)])


class ChoiceScorer:
    """Plans, scores and finishes the scoring sequences of a step."""

    def __init__(self, blocks: BlockManager, runner, vocab_size: int, intake: TokenIntake, stats,
                 fail: Callable) -> None:
        self.blocks = blocks
        self.runner = runner
        self.vocab_size = vocab_size
        self.intake = intake
        self.stats = stats
        self._fail = fail

    @staticmethod
    def start(seq: Sequence) -> None:
        """Hold back the prompt's last token: each choice is fed after it from a copy of the
        prompt's cache, so its logits score the choice's first token."""
        if not seq.request.prompt_token_ids:
            raise ValueError("scoring choices needs a non-empty prompt")
        seq.pending = seq.pending[:-1]
        seq.choices = ChoiceScores.for_choices(len(seq.request.score_choices))

    def plan(self, running: list[Sequence]) -> Plan:
        """(sequence, [(choice, branch)]) for sequences whose prompt is cached: each unscored
        choice runs in a branch of the sequence's blocks; choices that find no free blocks wait
        for the next step."""
        plan = []
        for seq in running:
            if not seq.scoring or seq.pending or seq.finished:
                continue
            branches = []
            for choice, score in enumerate(seq.choices.sums):
                if score is not None:
                    continue
                fork = self.blocks.fork(seq.table, 1 + len(seq.request.score_choices[choice]))
                if fork is None:
                    break
                branch, copy = fork
                if copy is not None:
                    self.runner.copy_blocks([copy])
                branches.append((choice, branch))
            if branches:
                plan.append((seq, branches))
            elif len(running) == 1:
                self._fail(seq, "a choice does not fit in the KV cache")
        return plan

    @staticmethod
    def rows(plan: Plan) -> list[tuple[list[int], list[int], int]]:
        """The forward's rows: (branch blocks, [last prompt token, *choice], cached length)."""
        rows = []
        for seq, choices in plan:
            last_prompt_token = seq.request.prompt_token_ids[-1]
            for choice, branch in choices:
                rows.append((branch.blocks, [last_prompt_token, *seq.request.score_choices[choice]], seq.cached_len))
        return rows

    def free_branches(self, plan: Plan) -> None:
        for _, choices in plan:
            for _, branch in choices:
                self.blocks.free(branch)

    def score(self, seq: Sequence, choice: int, logits: torch.Tensor) -> None:
        """Sum of the choice's token logprobs (raw model distribution), from the logits at the
        prompt's last token and after each of the choice's tokens but the last."""
        tokens = seq.request.score_choices[choice]
        logprobs = logits[: len(tokens), : self.vocab_size].float().log_softmax(dim=-1)
        ids = to_device(tokens, torch.long, logprobs.device)
        chosen = logprobs.gather(1, ids.view(-1, 1)).view(-1)
        top_n = min(seq.request.params.top_logprobs, logprobs.shape[1])
        pieces = [chosen.sum().view(1), chosen]
        if top_n:
            values, indices = logprobs.topk(top_n, dim=-1)
            pieces += [values.flatten(), indices.flatten()]
        # one read-back: float64 holds every float32 value and token id exactly
        host = torch.cat([piece.double() for piece in pieces]).cpu()
        n = len(tokens)
        seq.choices.sums[choice] = float(host[0])
        self.stats.scored_choices += 1
        top = [[]] * n
        if top_n:
            values_host = host[1 + n : 1 + n + n * top_n].view(n, top_n).tolist()
            indices_host = host[1 + n + n * top_n :].view(n, top_n).long().tolist()
            top = [list(zip(i, v)) for i, v in zip(indices_host, values_host)]
        seq.choices.token_logprobs[choice] = [
            TokenLogprobs(token, value, alternatives)
            for token, value, alternatives in zip(tokens, host[1 : 1 + n].tolist(), top)
        ]

    def finish(self, plan: Plan) -> None:
        """Sequences with every choice scored: normalise, pick one, emit its tokens."""
        for seq, _ in plan:
            if seq.finished or not seq.choices.complete:
                continue
            scores = torch.tensor(seq.choices.sums, dtype=torch.float64)
            seq.choices.normalised = scores.log_softmax(dim=0).tolist()  # no longer scoring
            try:
                self._emit(seq, _pick(seq, scores))
            except SequenceFailed as exc:
                self._fail(seq, str(exc), replace_finish=True)

    def _emit(self, seq: Sequence, choice: int) -> None:
        """Append the choice's tokens (through the constraint matcher) and finish."""
        matcher = seq.matcher
        want_logprobs = seq.request.params.logprobs
        for entry in seq.choices.token_logprobs[choice]:
            if matcher is not None and not guarded("constraint matcher", matcher.accept_token, entry.token_id):
                raise SequenceFailed(f"constraint rejected choice token {entry.token_id}")
            if self.intake.append(seq, entry.token_id, entry if want_logprobs else None):
                return
        self.intake.flush_text(seq)
        seq.finish("stop")


def _pick(seq: Sequence, scores: torch.Tensor) -> int:
    """Greedy: the most probable choice; sampling: a draw from the choices' distribution at the
    row's temperature, with one uniform from the row's seeded RNG."""
    params = seq.request.params
    if params.greedy:
        return int(scores.argmax())
    probs = (scores / params.temperature).softmax(dim=0)
    cumulative = probs.cumsum(dim=0)
    return min(int((cumulative < seq.row.rng.random()).sum()), len(probs) - 1)
