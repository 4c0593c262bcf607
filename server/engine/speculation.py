"""A sequence's speculation: where its drafts come from and how long they may be.

Prompt lookup serves constrained sequences (extraction, tool calls), whose values are copied
from the prompt; free text does not draft (:meth:`Engine._speculator`).

Two sources, one mechanism (:mod:`server.engine.draft_verifier` feeds and verifies both):

- the client's prediction (:class:`~server.engine.drafts.Draft`), followed whenever the output
  is aligned with it, at full length;
- prompt lookup (:class:`~server.engine.prompt_lookup.PromptLookup`), otherwise: its copies start
  at ``INITIAL_LENGTH`` tokens, double while their copied tokens are wholly accepted, shrink to
  what was kept plus one after a partial miss, and after ``k`` misses in a row wait
  ``2 ** (k - 1) - 1`` proposals (at most ``MAX_COOLDOWN``) before trying again (a first miss
  costs no wait: values copied from the prompt often start right after one). Only copied tokens
  count: forced text is always kept, and a guessed value start is refused more often than not.

A constrained row's lookup draft is composed with its grammar (:mod:`server.engine.grammar_draft`):
the text it forces, one copied span, and the value's closing; a prediction is cut at the first
token the matcher refuses (:meth:`DraftVerifier.plan`).
"""

from __future__ import annotations

from server.engine.drafts import Draft
from server.engine.grammar_draft import compose_draft
from server.engine.prompt_lookup import PromptLookup

INITIAL_LENGTH = 4
MAX_COOLDOWN = 32
ACCEPTANCE_WEIGHT = 0.3  # weight of the newest verification in the acceptance estimate
INITIAL_ACCEPTANCE = 0.5
RETRY_AFTER = 32  # steps a sequence priced out of drafting waits before it tries once more


class Speculator:
    """One sequence's draft sources, its draft length, and what its drafts achieved."""

    def __init__(self, prediction: Draft | None, lookup: PromptLookup | None, max_length: int) -> None:
        self.prediction = prediction
        self.lookup = lookup
        self.max_length = max_length
        self.length = min(INITIAL_LENGTH, max_length)
        self.acceptance = INITIAL_ACCEPTANCE  # estimated share of a draft's tokens that are kept
        self._priced_out = 0  # steps in a row the policy kept this sequence's drafts out
        self.source: str | None = None  # "prediction" or "prompt": where the last proposal came from
        self.kinds: list[str] = []  # per token of the last proposal: what it is (grammar_draft's kinds)
        self.lookup_accepted = 0
        self.lookup_rejected = 0
        self._misses = 0
        self._cooldown = 0

    @property
    def accepted(self) -> int:
        """Prediction tokens kept (usage's ``accepted_prediction_tokens``)."""
        return self.prediction.accepted if self.prediction is not None else 0

    @property
    def rejected(self) -> int:
        """Prediction tokens fed and not kept (usage's ``rejected_prediction_tokens``)."""
        return self.prediction.rejected if self.prediction is not None else 0

    @property
    def following_prediction(self) -> bool:
        """The output is on the client's prediction: the next draft comes from it."""
        return self.prediction is not None and self.prediction.aligned

    @property
    def ready(self) -> bool:
        """A proposal may come next step (the loop reads the last token before scheduling)."""
        if self.prediction is not None and self.prediction.aligned:
            return True
        return self.lookup is not None and self._cooldown == 0

    def proposal(self, limit: int, matcher=None) -> list[int]:
        """Up to ``limit`` draft tokens expected next ([] when no source has one); with the
        row's ``matcher``, a lookup draft is composed with its grammar."""
        self.source, self.kinds = None, []
        if self.prediction is not None:
            tokens = self.prediction.proposal(limit)
            if tokens:
                self.source, self.kinds = "prediction", ["prediction"] * len(tokens)
                return tokens
        if self.lookup is None:
            return []
        if self._cooldown > 0:
            self._cooldown -= 1
            return []
        if matcher is not None:
            composed = compose_draft(matcher, self.lookup, limit, self.length)
            tokens, self.kinds = composed.tokens, composed.kinds
        else:
            tokens = self.lookup.proposal(min(limit, self.length))
            self.kinds = ["copy"] * len(tokens)
        self.source = "prompt" if tokens else None
        return tokens

    def priced_out(self) -> None:
        """The step's cost kept this sequence's draft out; after ``RETRY_AFTER`` such steps its
        estimate is reset, so it tries again (the text it copies may have changed)."""
        self._priced_out += 1
        if self._priced_out >= RETRY_AFTER:
            self._priced_out = 0
            self.acceptance = INITIAL_ACCEPTANCE

    def observe(self, token: int) -> None:
        """The output gained ``token`` (sampled, forced or verified)."""
        if self.prediction is not None:
            self.prediction.observe(token)
        if self.lookup is not None:
            self.lookup.observe(token)

    def settle(self, fed: int, used: int) -> None:
        """The last proposal was verified: ``fed`` draft tokens fed, the first ``used`` kept."""
        if fed <= 0:
            return
        self.acceptance += ACCEPTANCE_WEIGHT * (used / fed - self.acceptance)
        if self.source == "prediction":
            self.prediction.settle(fed, used)
            return
        self.lookup_accepted += used
        self.lookup_rejected += fed - used
        # the copy's length follows its copied tokens that were tested (up to the first refused
        # one): forced text is always kept, and a guessed value start is refused more often than not
        tested = [i for i, kind in enumerate(self.kinds[:fed]) if kind == "copy" and i <= used]
        if not tested:
            return
        kept = sum(1 for i in tested if i < used)
        if kept == len(tested):
            self.length = min(self.max_length, 2 * self.length)
            self._misses = 0
        elif kept == 0:
            self._misses += 1
            self._cooldown = min(2 ** (self._misses - 1) - 1, MAX_COOLDOWN)
            self.length = max(1, self.length // 2)
        else:
            self.length = max(1, kept + 1)
            self._misses = 0
