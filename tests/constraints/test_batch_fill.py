"""constraints.backends.batch_fill: batched, parallel mask fills give the row-by-row fill's masks
and failures."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from constraints.backends.batch_fill import EMPTY_MASK, fill_bitmasks, fill_threads
from constraints.backends.llguidance import LIMITS, LLGuidanceMatcher
from constraints.backends.registry import make_backend
from constraints.backends.vocabulary import TokenizerContext
from constraints.backends.xgrammar import XGrammarMatcher
from constraints.spec import ConstraintSpec

from .conftest import VOCAB

WORDS = (VOCAB + 31) // 32
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "address": {"city": "London", "zip": "01815"}}
REGEX = r"(yes|no|maybe) [0-9]{1,4}"
REGEX_TEXT = "maybe 1234"


@pytest.fixture(scope="module")
def ctx(tok):
    return TokenizerContext(tok, VOCAB, len(tok), (tok.eos_token_id,), "test-batch-fill")


@pytest.fixture(scope="module")
def compiled(ctx):
    """(compiled constraint, token ids of a valid output) per backend: xgrammar and llguidance
    on a JSON schema, the token DFA (outlines) on a regex."""
    out = {}
    for name, spec, text in [
        ("xgrammar", ConstraintSpec("json_schema", SCHEMA), json.dumps(INSTANCE)),
        ("llguidance", ConstraintSpec("json_schema", SCHEMA), json.dumps(INSTANCE)),
        ("outlines", ConstraintSpec("regex", REGEX), REGEX_TEXT),
    ]:
        backend = make_backend(name, ctx)
        out[name] = (backend.load(spec, backend.compile(spec, spec.source)), ctx.encode(text))
    return out


def advanced(compiled, name: str, n: int):
    """A fresh matcher of ``name`` that accepted the first ``n`` tokens of its valid output."""
    constraint, ids = compiled[name]
    matcher = constraint.new_matcher()
    for t in ids[:n]:
        assert matcher.accept_token(t)
    matcher._accepted = n  # test bookkeeping (xgrammar keeps no count of its own)
    return matcher


def mixed_rows(compiled, per_backend: int) -> list:
    """Rows of all three backends interleaved, each advanced to a different point of its output."""
    rows = []
    for k in range(per_backend):
        for name in ("xgrammar", "llguidance", "outlines"):
            n = len(compiled[name][1])
            rows.append(advanced(compiled, name, (k * (n + 1)) // per_backend))
    return rows


def row_by_row(matchers) -> torch.Tensor:
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(mask, i)
    return mask


@pytest.fixture
def no_single_row_fill(monkeypatch):
    """Row-by-row fills of xgrammar and llguidance raise: a batched fill must not fall back."""

    def refuse(self, bitmask, row):
        raise AssertionError("filled row by row")

    monkeypatch.setattr(XGrammarMatcher, "fill_bitmask", refuse)
    monkeypatch.setattr(LLGuidanceMatcher, "fill_bitmask", refuse)
    return monkeypatch


@pytest.mark.parametrize("threads", [1, 4])
def test_batched_fill_equals_row_by_row_along_the_outputs(compiled, threads):
    matchers = mixed_rows(compiled, per_backend=10)
    outputs = [compiled[("xgrammar", "llguidance", "outlines")[k % 3]][1] for k in range(len(matchers))]
    positions = [_position(m) for m in matchers]
    for step in range(5):
        batched = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
        assert fill_bitmasks(matchers, batched, max_threads=threads) == {}
        assert torch.equal(batched, row_by_row(matchers)), f"step {step}"
        for k, m in enumerate(matchers):  # each row takes its output's next token (at the end: none)
            if positions[k] < len(outputs[k]):
                assert m.accept_token(outputs[k][positions[k]])
                positions[k] += 1


def _position(matcher) -> int:
    """Tokens accepted so far (each backend keeps its own history)."""
    if isinstance(matcher, LLGuidanceMatcher):
        return len(matcher._history)
    if isinstance(matcher, XGrammarMatcher):
        return matcher._accepted
    return len(matcher._states) - 1


def test_batched_groups_skip_the_row_by_row_fill(compiled, no_single_row_fill):
    matchers = [advanced(compiled, name, k) for k in range(8) for name in ("xgrammar", "llguidance")]
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    assert fill_bitmasks(matchers, mask, max_threads=2) == {}
    no_single_row_fill.undo()
    assert torch.equal(mask, row_by_row(matchers))


def test_llguidance_accepts_by_the_batched_mask(compiled):
    """accept_token checks the mask of the current state: after a batched fill it is the one
    the batch wrote (a token outside it is refused, the output's next token taken)."""
    ids = compiled["llguidance"][1]
    matchers = [advanced(compiled, "llguidance", k) for k in range(8)]
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    assert fill_bitmasks(matchers, mask, max_threads=2) == {}
    for k, m in enumerate(matchers):
        assert m._mask_at == len(m._history)
        assert list(m._mask) == mask[k].tolist()
        assert m.accept_token(ids[k])


def test_a_failing_row_fails_alone(compiled, tok):
    finished = advanced(compiled, "xgrammar", len(compiled["xgrammar"][1]))
    assert finished.accept_token(tok.eos_token_id)  # xgrammar raises when asked for a mask now
    matchers = [advanced(compiled, "xgrammar", k) for k in range(8)] + [finished, _Raising()]
    matchers += [advanced(compiled, "llguidance", 3), advanced(compiled, "outlines", 1)]
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    failures = fill_bitmasks(matchers, mask, max_threads=2)
    assert sorted(failures) == [8, 9]
    assert failures[8].startswith("constraint matcher failed: RuntimeError")
    assert failures[9] == "constraint matcher failed: ValueError: boom"
    assert bool((mask[8:10] == -1).all())
    healthy = [i for i in range(len(matchers)) if i not in failures]
    assert torch.equal(mask[healthy], row_by_row([matchers[i] for i in healthy]))


def test_empty_masks_are_failures(compiled):
    valid = torch.full((WORDS,), -1, dtype=torch.int32)
    valid[-1] = 0xFFFF  # as if the vocabulary ended 16 ids before the bitmask does
    matchers = [
        advanced(compiled, "xgrammar", 2),
        _Writing(0),
        advanced(compiled, "llguidance", 2),
        _Writing(1 << 20, last_word_only=True),  # only a bit past the vocabulary
        advanced(compiled, "outlines", 1),
    ]
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    failures = fill_bitmasks(matchers, mask, valid_bits=valid)
    assert failures == {1: EMPTY_MASK, 3: EMPTY_MASK}
    assert bool((mask[[1, 3]] == -1).all())
    assert torch.equal(mask[[0, 2, 4]], row_by_row([matchers[0], matchers[2], matchers[4]]))
    mask.zero_()
    assert fill_bitmasks(matchers, mask) == {}  # without valid_bits nothing is checked


def test_llguidance_error_state_in_a_batch_matches_row_by_row(compiled, ctx):
    """A matcher that hit a limit is replayed on a fresh template and masked as fill_bitmask does."""
    constraint, ids = compiled["llguidance"]

    def broken() -> LLGuidanceMatcher:
        tiny = llguidance.LLParserLimits(**{**LIMITS, "step_lexer_fuel": 1, "initial_lexer_fuel": 1})
        inner = llguidance.LLMatcher(ctx.cache["llguidance"], constraint._grammar, log_level=0, limits=tiny)
        assert inner.is_error()
        return LLGuidanceMatcher(ctx, inner, constraint)

    def rows():
        return [advanced(compiled, "llguidance", k) for k in range(7)] + [broken()]

    batched_rows, single_rows = rows(), rows()
    batched = torch.zeros((8, WORDS), dtype=torch.int32)
    assert fill_bitmasks(batched_rows, batched, max_threads=2) == {}
    assert torch.equal(batched, row_by_row(single_rows))
    assert batched_rows[7].accept_token(ids[0])  # the replayed matcher goes on


def test_a_matcher_listed_twice_is_filled_row_by_row(compiled):
    m = advanced(compiled, "xgrammar", 4)
    matchers = [m] + [advanced(compiled, "xgrammar", k) for k in range(8)] + [m]
    mask = torch.zeros((len(matchers), WORDS), dtype=torch.int32)
    assert fill_bitmasks(matchers, mask, max_threads=2) == {}
    assert torch.equal(mask, row_by_row(matchers))


@pytest.mark.parametrize(
    "rows, cap, threads", [(1, 16, 1), (7, 16, 1), (8, 16, 2), (64, 16, 16), (64, 6, 4), (200, 16, 16), (64, 1, 1)]
)
def test_fill_threads(rows, cap, threads):
    assert fill_threads(rows, cap) == threads


class _Raising:
    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 7  # partly written before failing: the row must still end up full
        raise ValueError("boom")


class _Writing:
    def __init__(self, value: int, last_word_only: bool = False) -> None:
        self.value, self.last_word_only = value, last_word_only

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.last_word_only:
            bitmask[row, -1] = self.value
        else:
            bitmask[row] = self.value

