"""A constrained row's draft composed with its grammar: forced text, a copied span, its closing.

Prompt lookup alone proposes what followed the output's last n-gram in the prompt; a grammar
knows more. Walking the row's matcher (state restored afterwards), a draft is built from:

1. the text the grammar forces next, tokenized canonically and in full (jump-forward appends
   all of it but its last token, which might merge with what follows: ``": "`` before a
   string value; drafted, the model confirms it and samples the value's first token in the
   same step);
2. one span copied by prompt lookup from the context plus the draft so far, as far as the
   grammar takes it (by tokens; where they do not line up with the prompt's, by text);
3. when the grammar refuses the span's next token (a copied value ends where the document's
   line does), the token that closes the value (:func:`constraints.backends.closing.closing_token`) and
   the text the grammar forces after it, tokenized canonically together (``", "city": "``).

Verification keeps the draft's tokens only where sampling agrees, so a wrong guess costs its
verification and nothing else; forced tokens that jump-forward appends after a kept token are
matched against the draft's next tokens (:meth:`DraftVerifier.verify`).

Each token carries its kind: ``forced`` (the grammar leaves no choice), ``guess`` (a copy's first
token right after forced text: which field the model copies is its own choice), ``copy`` (a
copied token after a model-chosen or copied one) and ``close`` (the token that ends a value);
the sequence's copy length follows its ``copy`` tokens alone (:meth:`Speculator.settle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from constraints.backends.closing import closing_token
from server.engine.prompt_lookup import PromptLookup

TAIL_TOKENS = 6  # output tokens whose text is matched against the prompt's
MAX_KEY_CHARS, MIN_KEY_CHARS = 24, 2  # the longest suffix of that text found in the prompt, at least this long
CHARS_PER_TOKEN = 8  # prompt text taken per wanted token (tokenized, then cut)


@dataclass
class ComposedDraft:
    """A draft's tokens and, per token, its kind (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


def compose_draft(matcher, lookup: PromptLookup, limit: int, copy_limit: int) -> ComposedDraft:
    """Up to ``limit`` draft tokens from the matcher's state, at most ``copy_limit`` of them
    copied from the context ``lookup`` indexes; the matcher's state is left unchanged."""
    composer = _Composer(matcher)
    try:
        composer.compose(lookup, limit, copy_limit)
        return ComposedDraft(composer.draft, composer.kinds)
    finally:
        matcher.rollback(composer.taken)


class _Composer:
    """One draft being composed: every token in it is accepted by the matcher (rolled back by
    the caller, ``taken`` of them)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.draft: list[int] = []
        self.kinds: list[str] = []
        self.taken = 0

    def compose(self, lookup: PromptLookup, limit: int, copy_limit: int) -> None:
        copied = False
        while len(self.draft) < limit:
            if self._take(self._canonical(self.matcher.forced_text()), limit, "forced"):
                continue
            if copied:
                break
            copied = True
            room = min(copy_limit, limit - len(self.draft))
            span = lookup.proposal_after(self.draft, room + 1) or self._text_span(lookup, room + 1)
            # right after forced text the copy is a guess at which value the model starts
            first = "guess" if self.kinds and self.kinds[-1] == "forced" else "copy"
            kept = self._take(span[:1], limit, first) and 1 + self._take(span[1:room], limit, "copy")
            if kept and kept < len(span) and not self._accepts(span[kept]):  # the value ends here
                self._close(limit)

    def _text_span(self, lookup: PromptLookup, limit: int) -> list[int]:
        """The continuation of the output's text where the prompt's text has it, tokenized
        canonically: where tokens do not line up (a value's first token ``Ġ"Ad`` against the
        prompt's ``ĠAda``), the text still does."""
        ctx = self.matcher.ctx
        prompt = lookup.prompt_text(ctx.decode)
        tail = ctx.decode(lookup.context[-TAIL_TOKENS:] + self.draft)
        for length in range(min(MAX_KEY_CHARS, len(tail)), MIN_KEY_CHARS - 1, -1):
            key = tail[-length:]
            at = prompt.rfind(key)
            if at >= 0 and not key.isspace():
                return ctx.encode(prompt[at + length : at + length + CHARS_PER_TOKEN * limit])[:limit]
        return []

    def _accepts(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            return False
        self.matcher.rollback(1)
        return True

    def _close(self, limit: int) -> None:
        token = closing_token(self.matcher)
        if token is None or not self.matcher.accept_token(token):
            return
        forced = self.matcher.forced_text()
        self.matcher.rollback(1)
        together = self._canonical(self.matcher.ctx.decode([token]) + forced)
        if self._take(together[:1], limit, "close"):
            self._take(together[1:], limit, "forced")
        else:
            self._take([token], limit, "close")

    def _take(self, tokens: list[int], limit: int, kind: str) -> int:
        """Accept ``tokens`` into the draft as far as the matcher takes them (and ``limit``
        allows); returns how many."""
        kept = 0
        for token in tokens[: limit - len(self.draft)]:
            if not self.matcher.accept_token(token):
                break
            self.taken += 1
            self.draft.append(token)
            self.kinds.append(kind)
            kept += 1
            if self.matcher.is_terminated():
                break
        return kept

    def _canonical(self, text: str) -> list[int]:
        """``text`` as the tokenizer writes it ([] when it does not round-trip)."""
        if not text:
            return []
        ctx = self.matcher.ctx
        ids = ctx.encode(text)
        return ids if ctx.decode(ids) == text else []
