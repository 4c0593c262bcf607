"""spec_from_request: every wire form, conflicts and malformed values."""

from __future__ import annotations

import pytest

from constraints import ConstraintSpec, InvalidConstraintError, spec_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def rf_schema(schema, **extra):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}}


@pytest.mark.parametrize(
    "fields, kind, source",
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", None),
        (rf_schema(SCHEMA), "json_schema", SCHEMA),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}, "json_schema", SCHEMA),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
        ({"guided_grammar": 'root ::= "a"'}, "grammar_ebnf", 'root ::= "a"'),
        ({"guided_grammar": 'start: "a" | "b"'}, "grammar_lark", 'start: "a" | "b"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"regex": "x+"}}, "regex", "x+"),
        ({"structured_outputs": {"choice": ["a"]}}, "choice", ("a",)),
        ({"structured_outputs": {"grammar": "root ::= [0-9]+"}}, "grammar_ebnf", "root ::= [0-9]+"),
        ({"structured_outputs": {"json_object": True}}, "json_object", None),
        ({"regex": "a|b"}, "regex", "a|b"),
        ({"ebnf": 'root ::= "x"'}, "grammar_ebnf", 'root ::= "x"'),
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}, "json_schema", SCHEMA),
    ],
)
def test_forms(fields, kind, source):
    spec = spec_from_request(fields)
    if kind is None:
        assert spec is None
        return
    assert spec.kind == kind
    assert spec.source == source


def test_structural_tag_forms():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert spec_from_request({"response_format": tag}).kind == "structural_tag"
    legacy = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    assert spec_from_request({"structured_outputs": {"structural_tag": legacy}}).kind == "structural_tag"


def test_options():
    spec = spec_from_request({"guided_json": SCHEMA, "guided_whitespace_pattern": r"[ ]?",
                              "guided_decoding_backend": "guidance"})
    assert spec.options == {"whitespace_pattern": "[ ]?", "backend": "llguidance"}
    spec = spec_from_request({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert spec.options == {"json_layout": "compact"}
    assert spec_from_request(rf_schema(SCHEMA, strict=False)).strict is False
    assert spec_from_request(rf_schema(SCHEMA, strict=True)).options == {}


def test_key_is_canonical():
    a = ConstraintSpec("json_schema", {"b": 1, "a": {"y": 2, "x": 1}}, {"strict": True, "backend": "auto"})
    b = ConstraintSpec("json_schema", {"a": {"x": 1, "y": 2}, "b": 1})
    assert a.key() == b.key() and a == b and hash(a) == hash(b)
    assert ConstraintSpec("json_schema", {}, {"strict": False}).key() != b.key()


@pytest.mark.parametrize(
    "fields, param",
    [
        (rf_schema([1, 2]), "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "hello world"}, "guided_grammar"),
        ({"structured_outputs": {"json": "[]"}}, "structured_outputs.json"),
        ({"json_schema": "{"}, "json_schema"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "nope"}, "guided_decoding_backend"),
    ],
)
def test_malformed(fields, param):
    with pytest.raises(InvalidConstraintError) as info:
        spec_from_request(fields)
    assert info.value.param == param
    assert info.value.code == "invalid_constraint"


def test_conflicts_named():
    with pytest.raises(InvalidConstraintError) as info:
        spec_from_request({**rf_schema(SCHEMA), "guided_regex": "a", "regex": "b"})
    msg = info.value.message
    assert "response_format.json_schema.schema" in msg and "guided_regex" in msg and "regex" in msg
    assert info.value.param == "response_format.json_schema.schema"


def test_unassigned_plane_characters_are_refused_up_front():
    """llguidance masks U+9D0F3's bytes as allowed but will not consume them (found by fuzzing)."""
    import pytest

    from constraints import UnsupportedConstraintError, spec_from_request

    with pytest.raises(UnsupportedConstraintError, match=r"U\+9D0F3"):
        spec_from_request({"guided_regex": "a\U0009D0F3b"})
    with pytest.raises(UnsupportedConstraintError):
        spec_from_request({"guided_json": {"const": "\U00040000"}})
    assert spec_from_request({"guided_regex": "\U0001F600|\U000E0041"}) is not None  # assigned planes are fine
