"""regex and choice: exact matching, the TokenDFA export and its agreement with the matcher."""

from __future__ import annotations

import pytest
import torch

from constraints import ConstraintSpec, InvalidConstraintError

from .conftest import allowed_ids, new_mask, walk_text


@pytest.fixture(scope="module")
def choice(compiler):
    return compiler.compile(ConstraintSpec("choice", ["yes", "no", "maybe so", "a.b|c"]))


@pytest.mark.parametrize("text, ok", [("yes", True), ("no", True), ("maybe so", True), ("a.b|c", True),
                                      ("ye", False), ("yess", False), ("nono", False), ("axb|c", False),
                                      ("", False)])
def test_choice_exact(choice, tok, text, ok):
    assert walk_text(choice, tok, text) is ok


def test_choice_uses_token_dfa(choice):
    assert choice.backend == "outlines"
    dfa = choice.token_dfa()
    assert dfa is not None and dfa.stop_token_ids == (2,)
    assert dfa.allowed.dtype == torch.int32 and dfa.allowed.shape[1] == 49152 // 32
    assert dfa.trans_offsets.shape[0] == dfa.num_states + 1
    assert dfa.trans_tokens.shape == dfa.trans_next.shape


@pytest.mark.parametrize("regex, good, bad", [
    (r"[a-z]+@[a-z]+\.com", ["joe@mail.com"], ["joe@mail.org", "@x.com"]),
    (r"\d{3}-\d{4}", ["555-1234"], ["5551234", "555-12345"]),
    (r"^(true|false)$", ["true", "false"], ["True"]),
    (r"(a+)+$", ["a", "aaaa"], ["b", ""]),
])
def test_regex(compiler, tok, regex, good, bad):
    c = compiler.compile(ConstraintSpec("regex", regex))
    for text in good:
        assert walk_text(c, tok, text), text
    for text in bad:
        assert not walk_text(c, tok, text), text


def test_token_dfa_agrees_with_matcher(compiler, tok):
    c = compiler.compile(ConstraintSpec("regex", r"(cat|dog)s? [0-9]{1,3}"))
    dfa = c.token_dfa()
    m = c.new_matcher()
    state = dfa.initial_state
    mask = new_mask()
    for t in tok.encode("dogs 42", add_special_tokens=False):
        mask.zero_()
        m.fill_bitmask(mask, 0)
        assert torch.equal(mask[0], dfa.allowed[state])
        lo, hi = int(dfa.trans_offsets[state]), int(dfa.trans_offsets[state + 1])
        tokens = dfa.trans_tokens[lo:hi].tolist()
        assert tokens == sorted(tokens)
        assert allowed_ids(mask) - {2} == set(tokens)
        state = int(dfa.trans_next[lo + tokens.index(t)])
        assert m.accept_token(t)
    assert bool(dfa.final[state])
    assert 2 in allowed_ids(dfa.allowed[state].unsqueeze(0))
    assert m.accept_token(2) and m.is_terminated()


def test_dfa_rollback_and_forced(compiler, tok):
    c = compiler.compile(ConstraintSpec("regex", "hello world [0-9]"))
    m = c.new_matcher()
    forced = m.forced_tokens()
    assert tok.decode(forced) in "hello world " and forced
    for t in forced:
        assert m.accept_token(t)
    m.rollback(len(forced))
    assert m.forced_tokens() == forced


def test_regex_matching_nothing_rejected(compiler):
    with pytest.raises(InvalidConstraintError) as info:
        compiler.compile(ConstraintSpec("regex", "a[^\\s\\S]b", param="guided_regex"))
    assert "matches no string" in info.value.message
    assert info.value.param == "guided_regex"


def test_invalid_regex(compiler):
    with pytest.raises(InvalidConstraintError):
        compiler.compile(ConstraintSpec("regex", "(unclosed"))


def test_grammars(compiler, tok):
    ebnf = compiler.compile(ConstraintSpec("grammar_ebnf", 'root ::= "x" [0-9]+'))
    assert walk_text(ebnf, tok, "x12") and not walk_text(ebnf, tok, "y12")
    lark = compiler.compile(ConstraintSpec("grammar_lark", 'start: "x" /[0-9]+/'))
    assert walk_text(lark, tok, "x12") and not walk_text(lark, tok, "x")
    with pytest.raises(InvalidConstraintError):
        compiler.compile(ConstraintSpec("grammar_ebnf", 'root ::= undefined_rule'))


def test_structural_tag(compiler, tok):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f>"]}
    c = compiler.compile(ConstraintSpec("structural_tag", tag))
    assert walk_text(c, tok, "hi <f>12</f>")
    assert not walk_text(c, tok, "hi <f>x</f>")


@pytest.mark.parametrize("backend", ["outlines", "llguidance", "xgrammar"])
@pytest.mark.parametrize("regex, good, bad", [
    ("a|ab|abc", ["a", "ab", "abc"], ["abcd", ""]),
    (r"[0-9]+|[0-9]+\.[0-9]+", ["12", "1.5"], ["1.", ".5"]),
    (r"b*|[a-z]*", ["", "bb", "abc"], ["A"]),
    (r"(?:\p{L}|x)*", ["ab\u00e9"], ["1"]),
    ("a*?", ["", "aaa"], ["b"]),
])
def test_union_is_union_on_every_backend(compiler, tok, backend, regex, good, bad):
    """outlines-core alone would drop `ab` from `a|ab` (leftmost-first matching)."""
    try:
        c = compiler.compile(ConstraintSpec("regex", regex, {"backend": backend}))
    except Exception:
        assert backend == "xgrammar"
        return
    for text in good:
        assert walk_text(c, tok, text), (backend, text)
    for text in bad:
        assert not walk_text(c, tok, text), (backend, text)


def test_choice_prefixes(compiler, tok):
    c = compiler.compile(ConstraintSpec("choice", ["a", "ab", "abc"]))
    assert c.backend == "outlines"
    assert all(walk_text(c, tok, t) for t in ("a", "ab", "abc")) and not walk_text(c, tok, "abcd")
