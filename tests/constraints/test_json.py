"""JSON-schema constraints: acceptance, masks, rollback, jump-forward, strictness, rewrites."""

from __future__ import annotations

import json
import re
import random

import jsonschema
import pytest

from constraints import (
    ConstraintSpec,
    InvalidConstraintError,
    UnsupportedConstraintError,
    spec_from_request,
)
from constraints.schema.analysis import rewrite_schema

from .conftest import allowed, allowed_ids, new_mask, walk_json, walk_text

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def person(compiler):
    return compiler.compile(ConstraintSpec("json_schema", PERSON))


@pytest.mark.parametrize(
    "doc, ok",
    [
        ({"name": "Ann", "age": 3}, True),
        ({"name": "Ann", "age": 3, "tags": ["a", "b"]}, True),
        ({"name": "Ann"}, False),
        ({"name": "Ann", "age": -1}, False),
        ({"name": "Ann", "age": 3, "tags": ["c"]}, False),
        ({"name": "Ann", "age": 3, "extra": 1}, False),
        ({"name": "x" * 21, "age": 3}, False),
    ],
)
def test_person_documents(person, tok, doc, ok):
    assert walk_json(person, tok, doc) is ok


def test_default_layout_is_json_dumps(person, tok):
    assert walk_text(person, tok, '{"name": "A", "age": 1}')
    assert not walk_text(person, tok, '{"name":"A","age":1}')
    assert not walk_text(person, tok, '{\n  "name": "A",\n  "age": 1\n}')


def test_flexible_whitespace_bounded(compiler, tok):
    flexible = compiler.compile(ConstraintSpec("json_schema", PERSON, {"json_layout": "flexible"}))
    assert walk_text(flexible, tok, '{"name":"A","age":1}')
    assert walk_text(flexible, tok, '{\n  "name": "A",\n  "age": 1\n}')
    assert not walk_text(flexible, tok, '{' + " " * 40 + '"name": "A", "age": 1}')


def test_bitmask_matches_accept_token(person, tok):
    ids = tok.encode(json.dumps({"name": "Bo", "age": 41}), add_special_tokens=False)
    m = person.new_matcher()
    rng = random.Random(0)
    mask = new_mask()
    for t in ids:
        mask.zero_()
        m.fill_bitmask(mask, 0)
        for probe in rng.sample(range(49152), 40) + [t, 2]:
            ok = m.accept_token(probe)
            assert ok == allowed(mask, probe), probe
            if ok:
                m.rollback(1)
        assert m.accept_token(t)
    assert not m.is_terminated()
    mask.zero_()
    m.fill_bitmask(mask, 0)
    assert allowed_ids(mask) == {2}  # the object is complete: only the stop token
    assert m.accept_token(2) and m.is_terminated()


def test_rollback_and_reset(person, tok):
    m = person.new_matcher()
    ids = tok.encode('{"name": "A", "age": 7}', add_special_tokens=False)
    for t in ids:
        assert m.accept_token(t)
    m.rollback(3)
    for t in ids[-3:]:
        assert m.accept_token(t)
    assert m.accept_token(2) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated()
    m.reset()
    assert m.accept_token(ids[0])


def test_rejected_token_leaves_state(person, tok):
    m = person.new_matcher()
    assert not m.accept_token(tok.encode("hello", add_special_tokens=False)[0])
    assert walk_json_from(m, tok, {"name": "A", "age": 1})


def walk_json_from(m, tok, doc):
    for t in tok.encode(json.dumps(doc), add_special_tokens=False):
        if not m.accept_token(t):
            return False
    return m.accept_token(2)


def _check_forced(m, tok):
    forced = m.forced_tokens()
    if forced:
        text = tok.decode(forced)
        assert tok.encode(text, add_special_tokens=False) == forced
        for t in forced:
            assert m.accept_token(t)
    return forced


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_tokens_canonical(compiler, tok, backend):
    schema = {"type": "object", "properties": {"temperature": {"type": "number"}},
              "required": ["temperature"], "additionalProperties": False}
    spec = ConstraintSpec("json_schema", schema, {"backend": backend})
    m = compiler.compile(spec).new_matcher()
    forced = _check_forced(m, tok)
    prefix = tok.decode(forced)
    target = '{"temperature": 12}'
    assert prefix.startswith('{"') and target.startswith(prefix)
    for t in tok.encode(target[len(prefix):], add_special_tokens=False):
        assert m.accept_token(t)
    assert m.forced_tokens() == [2]  # the document is complete: the stop token is forced


def test_forced_tokens_empty_when_free(compiler, tok):
    m = compiler.compile(ConstraintSpec("json_object")).new_matcher()
    assert m.forced_tokens() == [] or tok.decode(m.forced_tokens()) == "{"


def test_json_object(compiler, tok):
    c = compiler.compile(spec_from_request({"response_format": {"type": "json_object"}}))
    assert walk_json(c, tok, {"any": [1, {"x": None}]})
    assert not walk_json(c, tok, [1, 2])


def test_strict_rejects_unenforceable_keyword(compiler):
    spec = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "properties": {"tags": {
            "type": "array", "items": {"type": "object", "additionalProperties": False}, "uniqueItems": True}}}}}})
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(spec)
    err = info.value
    assert err.keyword == "uniqueItems" and err.pointer == "/properties/tags"
    assert err.param == "response_format.json_schema.schema"
    assert err.message.startswith("response_format.json_schema.schema: keyword 'uniqueItems' at /properties/tags")
    assert err.code == "unsupported_constraint"


def test_best_effort_when_not_strict(compiler, tok):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"strict": False}))
    assert walk_json(c, tok, [1, 2])


def test_forced_xgrammar_refuses_gaps(compiler):
    spec = ConstraintSpec("json_schema", {"type": "number", "multipleOf": 0.5}, {"backend": "xgrammar"})
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(spec)
    assert info.value.keyword == "multipleOf"


@pytest.mark.parametrize("schema, docs", [
    ({"type": "number", "minimum": 1.5, "exclusiveMaximum": 3}, [1.4, 1.5, 2.9, 3, 10]),
    ({"type": "integer", "minimum": -5, "maximum": 120}, [-6, -5, 120, 121]),
])
def test_xgrammar_numeric_bounds(compiler, tok, schema, docs):
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": "xgrammar"}))
    for doc in docs:
        assert walk_json(c, tok, doc) == jsonschema.Draft202012Validator(schema).is_valid(doc), doc


def test_xgrammar_pattern_with_length_is_a_gap(compiler):
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema, {"backend": "xgrammar"}))
    assert info.value.keyword == "maxLength"


def test_invalid_schema_has_pointer(compiler):
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "strng"}}})
    with pytest.raises(InvalidConstraintError) as info:
        compiler.compile(spec)
    assert info.value.pointer.startswith("/properties/a")


REWRITE_CASES = [
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ["x", 3, 2.5, None]),
    ({"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
     [{"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {}]),
    ({"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
      "if": {"properties": {"kind": {"const": "num"}}}, "then": {"required": ["n"]}},
     [{"kind": "num", "n": 1}, {"kind": "num"}, {"kind": "other"}, {"kind": "nu"}, {"kind": "numb"}, {}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, [{"a": 1}, {"a": 1, "b": 2}, {"b": 2}, {}]),
    ({"type": "string", "not": {"enum": ["red", "green"]}}, ["red", "green", "blue", "re", "greens", ""]),
    ({"type": "string", "not": {"maxLength": 2}}, ["ab", "abc", ""]),
    ({"type": "integer", "not": {"minimum": 5}}, [4, 5, 6]),
    ({"not": {"type": "null"}}, [None, 1, "x", [], {}]),
    ({"type": "array", "not": {"not": {"maxItems": 1}}}, [[], [1], [1, 2]]),
]


@pytest.mark.parametrize("schema, docs", REWRITE_CASES)
def test_rewrites_are_equivalent_and_enforced(compiler, tok, schema, docs):
    validator = jsonschema.validators.validator_for(schema)(schema)
    rewritten = rewrite_schema(schema)
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for doc in docs:
        expected = validator.is_valid(doc)
        assert jsonschema.validators.validator_for(rewritten)(rewritten).is_valid(doc) == expected, doc
        assert walk_json(compiled, tok, doc) == expected, doc


def test_unknown_format_is_annotation(compiler, tok):
    c = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "format": "file-path"}))
    assert walk_json(c, tok, "../a b")
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "number", "format": "utc-millisec"}
    c = compiler.compile(ConstraintSpec("json_schema", schema))  # any number is milliseconds
    assert walk_json(c, tok, 1732380000000) and walk_json(c, tok, -1.5) and not walk_json(c, tok, "1")


def test_spec_format_never_dropped(compiler, tok):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "uri"},
                                               "b": {"type": "string", "format": "idn-email"}}}
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert info.value.keyword == "format" and info.value.pointer == "/properties/b"
    assert "'idn-email' at /properties/b" in info.value.message  # not the first format used
    c = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "format": "json-pointer"}))
    assert walk_json(c, tok, "/a/b~1c") and not walk_json(c, tok, "a/b") and not walk_json(c, tok, "/~2")


URI_REFERENCES = ["http://example.com/a?b=c#d", "#/definitions/x", "../a/b", "//host:80/p", "a:b",
                  "http://[2001:db8::7]/c", "http://[v7.fe80::a+en1]", "", "?q", "/a//b"]
NOT_URI_REFERENCES = ["a b", "http://a/%zz", "http://[1::2::3]/", ":a", "http://a/<b>", "a\\b"]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("fmt", ["uri-reference", "iri", "iri-reference"])
def test_uri_and_iri_references_are_rfc3986_and_3987(compiler, tok, backend, fmt):
    c = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "format": fmt}, {"backend": backend}))
    relative = fmt != "iri"
    for text in URI_REFERENCES:
        assert walk_json(c, tok, text) is (relative or ":" in text.split("/")[0]), text
    assert not any(walk_json(c, tok, text) for text in NOT_URI_REFERENCES)


@pytest.mark.parametrize("fmt", ["uri-reference", "iri", "iri-reference"])
def test_uri_patterns_agree_with_a_validator(fmt):
    """The patterns against an independent RFC 3986 / 3987 implementation, on 20,000 random
    strings over URI delimiters, letters and characters that are never allowed."""
    import random

    from constraints.schema.keywords import FORMAT_PATTERNS

    if fmt == "uri-reference":
        from rfc3986_validator import validate_rfc3986

        def check(text: str) -> bool:
            return bool(validate_rfc3986(text, rule="URI_reference"))
    else:
        rfc3987 = pytest.importorskip("rfc3987")

        def check(text: str) -> bool:
            return rfc3987.match(text, rule={"iri": "IRI", "iri-reference": "IRI_reference"}[fmt]) is not None
    rx = re.compile(FORMAT_PATTERNS[fmt])
    rng = random.Random(7)
    alphabet = "ab:/?#[]@!$&'()*+,;=%-._~0F \u00e91<>\"{}|\\^`v\ue000"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))) for _ in range(20_000)]
    wrong = [t for t in texts + URI_REFERENCES + NOT_URI_REFERENCES if bool(rx.fullmatch(t)) != check(t)]
    assert not wrong, wrong[:5]


URI_TEMPLATES = ["http://example.com/{user}/x", "{+path}/here", "{?x,y*,z:30}", "/a%20b{#frag}",
                 "{/a.b,c}", "?A=[1]&~"]
NOT_URI_TEMPLATES = ["{}", "{a b}", "a b", "{x:0}", "{x:10000}", "%zz", "{a..b}", "a{b", "a}b",
                     "<a>", "{x*:2}"]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_uri_template_format_is_rfc6570(compiler, tok, backend):
    """``uri-template`` is enforced by an exact pattern of RFC 6570's grammar (MCPspec's
    resource references use it)."""
    schema = {"type": "string", "format": "uri-template"}
    c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": backend}))
    assert all(walk_json(c, tok, text) for text in URI_TEMPLATES)
    assert not any(walk_json(c, tok, text) for text in NOT_URI_TEMPLATES)


def test_extra_stop_tokens(tok):
    from constraints import ConstraintCompiler

    c = ConstraintCompiler(tok, 49152 + 64, stop_token_ids=[2, 0], max_workers=1)
    try:
        for spec in (ConstraintSpec("json_schema", {"type": "integer"}), ConstraintSpec("choice", ["ab"])):
            m = c.compile(spec).new_matcher()
            for t in tok.encode("12" if spec.kind == "json_schema" else "ab", add_special_tokens=False):
                assert m.accept_token(t)
            mask = __import__("torch").zeros((1, (49152 + 64 + 31) // 32), dtype=__import__("torch").int32)
            m.fill_bitmask(mask, 0)
            ids = allowed_ids(mask)
            assert {0, 2} <= ids and not any(i >= 49152 for i in ids)
            assert m.accept_token(0) and m.is_terminated()
    finally:
        c.close()


DRAFT4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize("schema, docs", [
    ({"type": "string", "maxLength": 2.0}, ["ab", "abc"]),
    ({"type": "string", "minLength": 2.0, "pattern": "^[a-z]*$"}, ["a", "ab"]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1.0, "maxItems": 2.0}, [[], [1], [1, 2, 3]]),
    ({"type": "object", "maxProperties": 1.0, "minProperties": 1.0}, [{}, {"a": 1}, {"a": 1, "b": 2}]),
    ({"$schema": DRAFT4, "type": "array", "maxItems": 1.0}, [[1], [1, 2]]),
    ({"$schema": DRAFT4, "type": "number", "minimum": 0, "exclusiveMinimum": True}, [0, 1]),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 1.0}}}, [{"a": "x"}, {"a": "xy"}]),
])
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_integral_floats_are_integers(compiler, tok, schema, docs, backend):
    try:
        c = compiler.compile(ConstraintSpec("json_schema", schema, {"backend": backend}))
    except UnsupportedConstraintError:
        assert backend == "xgrammar"
        return
    as_int = json.loads(json.dumps(schema).replace(".0,", ",").replace(".0}", "}"))
    validator = jsonschema.validators.validator_for(as_int)(as_int)
    for doc in docs:
        assert walk_json(c, tok, doc) == validator.is_valid(doc), (doc, backend)


def test_non_integral_bound_is_a_400(compiler):
    spec = spec_from_request({"guided_json": {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 2.5}}}})
    with pytest.raises(InvalidConstraintError) as info:
        compiler.compile(spec)
    assert info.value.keyword == "maxItems"
    assert info.value.pointer == "/properties/tags/maxItems"
    assert info.value.param == "guided_json"
