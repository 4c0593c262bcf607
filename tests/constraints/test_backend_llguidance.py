"""The llguidance matcher: ``accept_token`` takes exactly the tokens the current mask allows.

llguidance's mask allows only the canonical tokenization of bytes the grammar forces (after
``{"apiVersion":`` with the ``": "`` separator: ``Ġ"`` but no lone ``Ġ``), while its
``try_consume_tokens`` checks the grammar alone; the matcher must follow the mask.
"""

from __future__ import annotations

import json

import pytest

from constraints import ConstraintSpec

from .conftest import VOCAB, allowed, new_mask

SCHEMA = {
    "type": "object",
    "properties": {"apiVersion": {"type": "string", "enum": ["v1"]}, "code": {"type": "integer"}},
    "required": ["apiVersion", "code"],
    "additionalProperties": False,
}
LONE_SPACE = 216  # "Ġ" in the default tokenizer


def _agreement_on_every_token(matcher, mask) -> list[int]:
    """Tokens on which the filled ``mask`` and ``accept_token`` disagree (state left unchanged)."""
    wrong = []
    for t in range(VOCAB):
        if matcher.accept_token(t):
            matcher.rollback(1)
            if not allowed(mask, t):
                wrong.append(t)
        elif allowed(mask, t):
            wrong.append(t)
    return wrong


@pytest.fixture(scope="module")
def compiled(compiler):
    compiled = compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    assert compiled.backend == "llguidance"
    return compiled


def test_mask_and_accept_agree_on_every_token_along_an_instance(compiled, tok):
    ids = tok.encode(json.dumps({"apiVersion": "v1", "code": 404}), add_special_tokens=False)
    matcher = compiled.new_matcher()
    mask = new_mask()
    for step, token in enumerate(ids):
        mask.zero_()
        matcher.fill_bitmask(mask, 0)
        assert _agreement_on_every_token(matcher, mask) == [], f"step {step}"
        assert matcher.accept_token(token), f"step {step}"


def test_a_lone_space_the_mask_forbids_is_refused_without_a_mask_filled_first(compiled, tok):
    prefix = tok.encode('{"apiVersion":', add_special_tokens=False)
    matcher = compiled.new_matcher()
    assert all(matcher.accept_token(t) for t in prefix)
    assert not matcher.accept_token(LONE_SPACE)  # no fill_bitmask since the last token
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    assert not allowed(mask, LONE_SPACE)
    quote_space = tok.encode(' "', add_special_tokens=False)
    assert len(quote_space) == 1 and allowed(mask, quote_space[0])
    assert matcher.accept_token(quote_space[0])
    matcher.rollback(1)  # back to the same state: the mask computed there still holds
    assert not matcher.accept_token(LONE_SPACE)
    assert matcher.accept_token(quote_space[0])
