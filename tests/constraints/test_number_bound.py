"""The bounded number form applied to compiled JSON constraints (``constraints.backends.number_bound``):
the default one-line layouts keep numbers bounded, ``json_numbers: "any"`` and the flexible layout
keep any JSON number; a number the schema leaves no bounded spelling for goes free (a satisfiable
schema stays satisfiable); the mask and accept_token agree at every step, also through the batched
fill; rollback restores the form's state."""

from __future__ import annotations

import json

import pytest
import torch

from constraints import ConstraintError, ConstraintSpec
from constraints.backends.batch_fill import fill_bitmasks
from constraints.backends.number_bound import BoundedNumbers

from .conftest import VOCAB, allowed, new_mask, walk_text

PRICE = {"type": "object", "properties": {"price": {"type": "number"}}, "required": ["price"]}
LONG = ("1E+0001", "31.00000000000001E+00000000000000000000000001", "1.23456789012345678", "0.00000001")


def _narrowed_by(matcher, kind) -> bool:
    """Whether ``matcher`` is, or wraps at some depth, a matcher of ``kind``."""
    while matcher is not None:
        if isinstance(matcher, kind):
            return True
        matcher = matcher.__dict__.get("inner")
    return False


def _compile(compiler, schema, **options):
    return compiler.compile(ConstraintSpec("json_schema", schema, options))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_json_numbers_any_keeps_long_numbers_under_the_default_layout(compiler, tok, backend):
    bounded = _compile(compiler, PRICE, backend=backend)
    free = _compile(compiler, PRICE, backend=backend, json_numbers="any")
    assert _narrowed_by(bounded.new_matcher(), BoundedNumbers) and not _narrowed_by(free.new_matcher(), BoundedNumbers)
    for text in LONG:
        assert not walk_text(bounded, tok, f'{{"price": {text}}}'), text
        assert walk_text(free, tok, f'{{"price": {text}}}'), text
    for value in (3.14, 1e16, 5e-324, -2.5e-05, 123456789012345678):
        assert walk_text(bounded, tok, json.dumps({"price": value})), value


def test_json_object_is_bounded_and_regexes_are_not(compiler, tok):
    assert isinstance(compiler.compile(ConstraintSpec("json_object", None)).new_matcher(), BoundedNumbers)
    regex = compiler.compile(ConstraintSpec("regex", "[0-9]{30}"))
    assert walk_text(regex, tok, "1" * 30)


# the backends write a bounded range without an exponent: 1.5e-08 is no spelling they allow, and
# 0.000000015 has 7 zeros after the point, one more than the bound's
TINY = {"type": "number", "minimum": 0.00000001, "maximum": 0.00000002}


def test_a_number_with_no_bounded_spelling_goes_free(compiler, tok):
    compiled = _compile(compiler, TINY)
    assert walk_text(compiled, tok, "0.000000015")
    assert _compile(compiler, TINY, json_numbers="any") is not None


def test_the_bound_applies_again_after_a_free_number(compiler, tok):
    schema = {"type": "array", "prefixItems": [TINY, {"type": "number"}], "items": False, "minItems": 2}
    compiled = _compile(compiler, schema)
    assert walk_text(compiled, tok, "[0.000000015, 1.5]")
    assert not walk_text(compiled, tok, "[0.000000015, 1E+0001]")


def _check_agreement(matcher, tok, text: str) -> None:
    """At every step the mask allows the next token and a sample of others exactly as accept does."""
    ids = tok.encode(text, add_special_tokens=False)
    probes = tok.encode("0123456789 1 12 123 .5 e+ E- 0. 00 -1 9999 \" }", add_special_tokens=False)
    for token in ids:
        mask = new_mask()
        matcher.fill_bitmask(mask, 0)
        for probe in set(probes) | {token}:
            if matcher.accept_token(probe):
                assert allowed(mask, probe), (text, tok.decode([probe]))
                matcher.rollback(1)
            else:
                assert not allowed(mask, probe), (text, tok.decode([probe]))
        assert matcher.accept_token(token)


def test_mask_and_accept_agree_through_numbers(compiler, tok):
    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": TINY,
                                               "c": {"type": "array", "items": {"type": "number"}}}}
    compiled = _compile(compiler, schema)
    _check_agreement(compiled.new_matcher(), tok, '{"a": 1.2345678901234567, "b": 0.000000015, '
                                                  '"c": [0.000001, 1e-300, 12.5]}')


def test_rollback_restores_the_form(compiler, tok):
    matcher = _compile(compiler, PRICE).new_matcher()
    ids = tok.encode('{"price": 1.2345678901234567', add_special_tokens=False)
    for token in ids:
        assert matcher.accept_token(token)
    digit = tok.convert_tokens_to_ids("8")
    assert not matcher.accept_token(digit)  # an 18th significant digit
    matcher.rollback(1)  # back before the 17th
    assert matcher.accept_token(tok.convert_tokens_to_ids("7")) and matcher.accept_token(tok.convert_tokens_to_ids("}"))


def test_the_batched_fill_equals_row_by_row(compiler, tok):
    compiled = _compile(compiler, PRICE, backend="xgrammar")
    prefixes = ['{"price": 1', '{"price": 1234567890123456', '{"price": 1.5e12', '{"price": 0.00000']
    matchers = []
    for prefix in prefixes:
        matcher = compiled.new_matcher()
        for token in tok.encode(prefix, add_special_tokens=False):
            assert matcher.accept_token(token), prefix
        matchers.append(matcher)
    batched = torch.zeros((len(matchers), new_mask().shape[1]), dtype=torch.int32)
    assert not fill_bitmasks(matchers, batched, max_threads=2)
    for row, matcher in enumerate(matchers):
        single = new_mask()
        matcher.fill_bitmask(single, 0)
        assert torch.equal(single[0], batched[row]), prefixes[row]
    assert VOCAB > 0


def test_a_bad_json_numbers_value_is_refused():
    with pytest.raises(ConstraintError, match="json_numbers"):
        ConstraintSpec("json_schema", PRICE, {"json_numbers": "short"})
