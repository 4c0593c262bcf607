"""Every backend and request form reads a regex the same (ECMA-262) way; no output ends mid-character."""

from __future__ import annotations

import pytest

from constraints import ConstraintSpec, InvalidConstraintError, UnsupportedConstraintError, spec_from_request

from .conftest import allowed_ids, new_mask, walk_json, walk_text

PHONE = r"\d{3}-\d{3}-\d{4}"
REGEX_FORMS = [
    {"guided_regex": PHONE},
    {"structured_outputs": {"regex": PHONE}},
    {"regex": PHONE},  # SGLang
]
SCHEMA_FORMS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "pattern": f"^{PHONE}$"}}}},
    {"guided_json": {"type": "string", "pattern": f"^{PHONE}$"}},
]


def _with_backend(spec: ConstraintSpec, backend: str) -> ConstraintSpec:
    return ConstraintSpec(spec.kind, spec.source, {**spec.options, "backend": backend}, param=spec.param)


def _compiled_per_backend(compiler, spec, backends):
    out = {}
    for backend in backends:
        try:
            out[backend] = compiler.compile(_with_backend(spec, backend))
        except UnsupportedConstraintError:
            continue
    assert out, "no backend compiled the constraint"
    return out


def _allowed_texts(matcher, tok) -> set[str]:
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    return {tok.decode([t]) for t in allowed_ids(mask) - {2}}


def _digits_only(texts: set[str]) -> bool:
    return bool(texts) and all(t and all(c in "0123456789" for c in t) for t in texts)


@pytest.mark.parametrize("form", REGEX_FORMS + SCHEMA_FORMS)
def test_phone_digits_are_ascii_everywhere(compiler, tok, form):
    spec = spec_from_request(form)
    backends = ["outlines", "llguidance", "xgrammar"] if spec.kind == "regex" else ["llguidance", "xgrammar"]
    quote = '"' if spec.kind == "json_schema" else ""
    for backend, compiled in _compiled_per_backend(compiler, spec, backends).items():
        m = compiled.new_matcher()
        for t in tok.encode(quote, add_special_tokens=False):
            assert m.accept_token(t)
        assert _digits_only(_allowed_texts(m, tok)), backend
        for t in tok.encode("555-12", add_special_tokens=False):
            assert m.accept_token(t), backend
        assert _digits_only(_allowed_texts(m, tok)), backend
        assert not m.accept_token(tok.encode("\U0001FBF8", add_special_tokens=False)[0]), backend
        assert walk_text(compiled, tok, quote + "555-123-4567" + quote), backend


@pytest.mark.parametrize("backend", ["outlines", "llguidance", "xgrammar"])
@pytest.mark.parametrize("regex, good, bad", [
    (r"\w+", ["a_Z9"], ["\u00e9t\u00e9", "a-b"]),
    (r"\s", [" ", "\u3000", "\u2028"], ["\x85", "x"]),
    (r"a.c", ["abc", "a\u00e9c"], ["a\nc", "a\u2028c"]),
    (r"[^\d\s]+", ["ab", "\u0663"], ["a1", "a b"]),
    (r"\p{L}+\d", ["\u00e9t\u00e97"], ["\u00e9t\u00e9\u0663"]),
])
def test_same_language_on_every_backend(compiler, tok, backend, regex, good, bad):
    try:
        c = compiler.compile(ConstraintSpec("regex", regex, {"backend": backend}))
    except (UnsupportedConstraintError, InvalidConstraintError):
        assert backend == "xgrammar"  # xgrammar has no \p{..}
        return
    for text in good:
        assert walk_text(c, tok, text), (backend, text)
    for text in bad:
        assert not walk_text(c, tok, text), (backend, text)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("pattern, good, bad", [
    ('^[^,"]+$', ["a\\b", "x\ny"], ['a"b', "a,b", ""]),  # MaskBench Github_medium o37613
    ("^[^\\\\]*$", ['a"b', ""], ["a\\b"]),
    ('^[^"]*$', ["a\tb"], ['"']),
])
def test_a_negated_class_refuses_the_escaped_character(compiler, tok, backend, pattern, good, bad):
    """llguidance 1.9.1 quoted ``[^"]`` so that the escape ``\\"`` got through. (xgrammar
    writes no escapes at all in a pattern string: narrower, so ``good`` is llguidance's.)"""
    schema = {"type": "string", "pattern": pattern}
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": backend}))
    for text in good if backend == "llguidance" else ["abc"]:
        assert walk_json(c, tok, text), (backend, text)
    for text in bad:
        assert not walk_json(c, tok, text), (backend, text)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_schema_patterns_past_the_bmp(compiler, tok, backend):
    """``[\\D.]`` spells its class up to ``\\U0010ffff``, which xgrammar's schema patterns read
    as letters unless written ``\\u{10ffff}``."""
    schema = {"type": "array", "items": {"type": "string", "pattern": r"^[\D.]+$"}}
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": backend}))
    assert walk_json(c, tok, ["ab<.>", "~"]) and not walk_json(c, tok, ["a1"])


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_schema_patterns_with_optional_groups(compiler, tok, backend):
    """xgrammar 0.2.8 read ``a(?:xb*)?`` in a schema pattern as ``ax?b*``."""
    schema = {"type": "string", "pattern": r"^a(?:x[b]*)?c$"}
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": backend}))
    assert all(walk_json(c, tok, text) for text in ["ac", "axc", "axbbc"])
    assert not any(walk_json(c, tok, text) for text in ["abc", "ab", "axb"])


def test_pattern_properties_and_lark(compiler, tok):
    schema = {"type": "object", "patternProperties": {r"^\d+$": {"type": "integer"}},
              "additionalProperties": False}
    c = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(c, tok, {"12": 1}) and not walk_json(c, tok, {"\u0663": 1})
    lark = compiler.compile(ConstraintSpec("grammar_lark", r"start: /\d+/ /./"))
    assert walk_text(lark, tok, "12x") and not walk_text(lark, tok, "\u06633x")
    assert not walk_text(lark, tok, "12\n")


def test_structural_tag_schema_pattern(compiler, tok):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "string", "pattern": r"^\d+$"}, "end": "</f>"}],
           "triggers": ["<f>"]}
    c = compiler.compile(ConstraintSpec("structural_tag", tag))
    assert walk_text(c, tok, 'x <f>"12"</f>') and not walk_text(c, tok, 'x <f>"\u0663"</f>')


# -- no output ends inside a multi-byte character -------------------------------------------------

MULTIBYTE = "a\U0001FBF8\u5b50\u00e9"  # 4-, 3- and 2-byte characters; the first is split over tokens


@pytest.mark.parametrize("spec, text", [
    (ConstraintSpec("regex", "[^x]{0,6}", {"backend": "outlines"}), MULTIBYTE),
    (ConstraintSpec("regex", "[^x]{0,6}", {"backend": "llguidance"}), MULTIBYTE),
    (ConstraintSpec("regex", "[^x]{0,6}", {"backend": "xgrammar"}), MULTIBYTE),
    (ConstraintSpec("regex", r"\p{L}*|.*", {"backend": "llguidance"}), MULTIBYTE),
    (ConstraintSpec("grammar_lark", "start: /[^x]*/"), MULTIBYTE),
    (ConstraintSpec("grammar_ebnf", "root ::= [^x]*"), MULTIBYTE),
    (ConstraintSpec("json_schema", {"type": "string"}, {"backend": "llguidance"}), f'"{MULTIBYTE}"'),
    (ConstraintSpec("json_schema", {"type": "string"}, {"backend": "xgrammar"}), f'"{MULTIBYTE}"'),
])
def test_stop_only_on_character_boundaries(compiler, tok, spec, text):
    m = compiler.compile(spec).new_matcher()
    done = b""
    split_seen = False
    for t in tok.encode(text, add_special_tokens=False):
        mask = new_mask()
        m.fill_bitmask(mask, 0)
        whole = _is_utf8(done)
        split_seen |= not whole
        if not whole:
            assert 2 not in allowed_ids(mask), done
            assert not m.accept_token(2)
        assert m.accept_token(t)
        done += _token_bytes(tok, t)
    assert split_seen  # the text really splits a character between tokens


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _token_bytes(tok, t: int) -> bytes:
    import xgrammar as xgr

    info = getattr(_token_bytes, "info", None)
    if info is None:
        info = _token_bytes.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
    return bytes(info.decoded_vocab[t])


def test_byte_mode_regex_is_refused(compiler):
    with pytest.raises(InvalidConstraintError):
        compiler.compile(ConstraintSpec("regex", r"(?-u:[\x80-\xff])"))
