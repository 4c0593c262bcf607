"""The llguidance matcher: ``accept_token`` takes exactly the tokens the current mask allows.

llguidance's own mask allows only the canonical tokenization of the bytes the grammar forces,
taken alone (after ``{"apiVersion":`` with the ``": "`` separator: ``Ġ"`` but no lone ``Ġ``),
while its ``try_consume_tokens`` checks the grammar alone. The matcher allows every token that
spells a prefix of the forced bytes (a valid instance may be tokenized across them), and
accepts exactly what its mask allows."""

from __future__ import annotations

import json

import pytest

from constraints import ConstraintSpec

from .conftest import VOCAB, allowed, new_mask, walk_json

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


def test_prefixes_of_the_forced_bytes_are_allowed_by_mask_and_accept_alike(compiled, tok):
    """After ``{"apiVersion":`` the bytes `` "v1", "code": `` are forced: llguidance alone allows
    only ``Ġ"``; every token spelling a prefix of them (the lone ``Ġ`` too) is grammatical and is
    allowed, by the mask and by accept_token, with or without a mask filled first."""
    prefix = tok.encode('{"apiVersion":', add_special_tokens=False)
    quote_space = tok.encode(' "', add_special_tokens=False)
    other = tok.encode(" [", add_special_tokens=False)  # not a prefix of the forced bytes
    assert len(quote_space) == 1 and len(other) == 1
    matcher = compiled.new_matcher()
    assert all(matcher.accept_token(t) for t in prefix)
    assert not matcher.accept_token(other[0])  # no fill_bitmask since the last token
    assert matcher.accept_token(LONE_SPACE)
    matcher.rollback(1)
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, LONE_SPACE) and allowed(mask, quote_space[0]) and not allowed(mask, other[0])
    assert _agreement_on_every_token(matcher, mask) == []


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        # MaskBench Github_medium o73815: ' "#' '!"' spans the forced ' "#!' and the closing quote
        ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^#!"}}},
         [{"p": "#!"}, {"p": "#!x"}], [{"p": "#"}, {"p": "!#"}]),
        # MaskBench Github_medium o81167: '"}' '},' where '"}}' is forced after the enum value
        ({"type": "object", "properties": {
            "o": {"type": "object", "required": ["a"], "additionalProperties": False, "properties": {
                "a": {"type": "object", "properties": {"k": {"enum": ["executable", "zip"]}},
                      "required": ["k"], "additionalProperties": False}}},
            "c": {"type": "integer"}}},
         [{"o": {"a": {"k": "executable"}}, "c": 1}, {"o": {"a": {"k": "zip"}}}],
         [{"o": {"a": {"k": "exe"}}, "c": 1}, {"o": {"a": {"k": "zip"}, "b": 1}}]),
    ],
)
def test_a_valid_instance_tokenized_across_forced_bytes_is_accepted(compiler, tok, schema, valid, invalid):
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert compiled.backend == "llguidance"
    for value in valid:
        assert walk_json(compiled, tok, value), value
    for value in invalid:
        assert not walk_json(compiled, tok, value), value


# two small objects (each in any of its 24 property orders) beside a oneOf: at `{"` llguidance's
# Earley row holds about 2,200 items (MaskBench Github_medium o227, whose valid instances an
# item limit of 2,000 cut short mid-key)
BOX = {"type": "object", "properties": {k: {"type": "integer"} for k in ("left", "right", "top", "bottom")}}
BOXES = {
    "type": "object",
    "properties": {"size": BOX, "offset": BOX, "name": {"type": "string"}},
    "oneOf": [
        {"properties": {"kind": {"enum": ["url"]}, "url": {"type": "string", "minLength": 1}}, "required": ["kind", "url"]},
        {"properties": {"kind": {"enum": ["html"]}, "html": {"type": "string", "minLength": 1}}, "required": ["kind", "html"]},
    ],
}
BOXES_VALUE = {"size": {"left": 1, "right": 2, "top": 3, "bottom": 4},
               "offset": {"top": 0, "left": 0, "right": 0, "bottom": 0}, "name": "x", "kind": "url", "url": "u"}


def test_small_objects_in_any_order_fit_the_parser_limits(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", BOXES))
    assert compiled.backend == "llguidance"
    matcher = compiled.new_matcher()
    mask = new_mask()
    for step, token in enumerate([*tok.encode(json.dumps(BOXES_VALUE), add_special_tokens=False), 2]):
        matcher.fill_bitmask(mask, 0)
        assert allowed(mask, token) and matcher.accept_token(token), f"step {step}: {matcher.error}"
    assert matcher.error is None and matcher.is_terminated()


def test_a_parser_limit_hit_keeps_mask_and_accept_in_agreement(compiler, tok, monkeypatch):
    """With a row limit the grammar exceeds, the limit is hit while probing the forced key bytes
    and while taking a token: at every step the mask and accept_token still agree, and once in
    the error state only the stop token is allowed and taken."""
    from constraints.backends import llguidance as backend_llguidance

    compiled = compiler.compile(ConstraintSpec("json_schema", BOXES))
    monkeypatch.setitem(backend_llguidance.LIMITS, "max_items_in_row", 400)
    tight = backend_llguidance.LLGuidanceCompiled(compiled.spec, compiled._ctx, compiled._grammar)
    matcher = tight.new_matcher()
    mask = new_mask()
    for step, token in enumerate(tok.encode(json.dumps(BOXES_VALUE), add_special_tokens=False)):
        mask.zero_()
        matcher.fill_bitmask(mask, 0)
        if matcher.error is not None:
            assert _agreement_on_every_token(matcher, mask) == [], f"step {step}"
            assert allowed(mask, 2) and matcher.accept_token(2) and matcher.is_terminated()
            break
        assert allowed(mask, token) == matcher.accept_token(token), f"step {step}"
    else:
        pytest.fail("the row limit was never hit")


# MaskBench Handwritten allany22: a string under nested negations of patterns; after `"]:` one
# mask step costs about 250k of lexer fuel, more than the normal per-step budget
_NOT = {f"n{i}{j}": {"not": {"anyOf": [{"pattern": first}, {"pattern": a}, {"pattern": b}]}}
        for i, first, pairs in ((1, "^....$", (("ab1", "b12"), ("bc1", "c12"), ("ca1", "a12"))),
                                (2, "^[\\w]*$", (("\\d\\d", "[a|b]"), ("\\d\\d", "[b|c]"), ("\\d\\d", "[c|a]"))),
                                (3, "^[\\w]+", (("1.*2", "ac"), ("1.*2", "a2"), ("1.*2", "a1"))))
        for j, (a, b) in enumerate(pairs, 1)}
NEGATIONS = {
    "type": "string",
    "anyOf": [{"not": {"allOf": [{"$ref": f"#/definitions/n{i}{j}"} for j in (1, 2, 3)]}} for i in (1, 2, 3)],
    "pattern": "[aA][12].*[zZ]", "minLength": 10, "maxLength": 90,
    "definitions": _NOT,
}
QUOTE_BRACKET_COLON = 23024  # '"]:' in the default tokenizer


def _step_after_quote_bracket(compiler, tok) -> tuple:
    compiled = compiler.compile(ConstraintSpec("json_schema", NEGATIONS))
    assert compiled.backend == "llguidance"
    assert tok.decode([QUOTE_BRACKET_COLON]) == '"]:'
    matcher = compiled.new_matcher()
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask, QUOTE_BRACKET_COLON) and matcher.accept_token(QUOTE_BRACKET_COLON)
    mask.zero_()
    matcher.fill_bitmask(mask, 0)
    return matcher, mask


def test_a_step_over_the_lexer_fuel_is_replayed_with_more_fuel(compiler, tok):
    """The step that runs out of fuel is replayed once with RESCUE_FUEL times as much: the string
    goes on (any character may follow) instead of the request failing."""
    matcher, mask = _step_after_quote_bracket(compiler, tok)
    assert matcher.error is None
    assert allowed(mask, tok.encode("a", add_special_tokens=False)[0]) and not allowed(mask, 2)


def test_without_the_rescue_the_same_step_is_a_parser_limit(compiler, tok, monkeypatch):
    from constraints.backends import llguidance as backend_llguidance

    monkeypatch.setattr(backend_llguidance, "RESCUE_FUEL", 1)
    matcher, mask = _step_after_quote_bracket(compiler, tok)
    assert "too many expressions" in (matcher.error or "")
    assert allowed(mask, 2) and int((mask != 0).sum()) == 1  # only the stop token
