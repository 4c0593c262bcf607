"""JSON layout: json.dumps by default, compact or flexible on request, the same on every backend."""

from __future__ import annotations

import json

import pytest

from constraints import ConstraintSpec, InvalidConstraintError, UnsupportedConstraintError, spec_from_request

from .conftest import walk_text

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "address"],
}
CASES = [
    (NESTED, {"name": "Ann", "address": {"city": "Paris", "zip": "75001"}}),
    ({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}, [[1, 2], [], [3]]),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "number"},
                                       "ok": {"type": "boolean"}, "none": {"type": "null"}},
      "required": ["color", "n", "ok", "none"]},
     {"color": "green", "n": 1.5, "ok": True, "none": None}),
    ({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
     {"text": 'line1\nline2 "quoted"\ttab back\\slash caf\u00e9 \u2028 \U0001F600'}),
    ({"type": "object", "properties": {"meta": {}}, "required": ["meta"]},
     {"meta": {"k": [1, 2.5, "x"], "j": {"a": None, "b": False}}}),
    (None, {"a": [1, {"b": None}], "c": {}, "d": []}),  # json_object
]
IDS = ["nested", "arrays", "enum", "escapes", "untyped", "json_object"]


def _spec(schema, options) -> ConstraintSpec:
    if schema is None:
        return ConstraintSpec("json_object", None, options)
    return ConstraintSpec("json_schema", schema, options)


def _compiled(compiler, schema, layout: str | None):
    out = {}
    for backend in ("xgrammar", "llguidance"):
        options = {"backend": backend} | ({"json_layout": layout} if layout else {})
        try:
            out[backend] = compiler.compile(_spec(schema, options))
        except UnsupportedConstraintError:
            continue
    assert set(out) == {"xgrammar", "llguidance"}
    return out


def _texts(instance) -> dict[str, str]:
    return {
        "dumps": json.dumps(instance),
        "compact": json.dumps(instance, separators=(",", ":")),
        "indent": json.dumps(instance, indent=2),
        "unicode": json.dumps(instance, ensure_ascii=False),
    }


@pytest.mark.parametrize("schema, instance", CASES, ids=IDS)
def test_default_is_json_dumps(compiler, tok, schema, instance):
    texts = _texts(instance)
    for backend, c in _compiled(compiler, schema, None).items():
        assert walk_text(c, tok, texts["dumps"]), backend
        assert walk_text(c, tok, texts["unicode"]), backend
        assert not walk_text(c, tok, texts["indent"]), backend
        if texts["compact"] != texts["dumps"]:
            assert not walk_text(c, tok, texts["compact"]), backend


@pytest.mark.parametrize("schema, instance", CASES, ids=IDS)
def test_compact(compiler, tok, schema, instance):
    texts = _texts(instance)
    for backend, c in _compiled(compiler, schema, "compact").items():
        assert walk_text(c, tok, texts["compact"]), backend
        assert not walk_text(c, tok, texts["indent"]), backend
        if texts["compact"] != texts["dumps"]:
            assert not walk_text(c, tok, texts["dumps"]), backend


@pytest.mark.parametrize("schema, instance", CASES, ids=IDS)
def test_flexible(compiler, tok, schema, instance):
    texts = _texts(instance)
    for backend, c in _compiled(compiler, schema, "flexible").items():
        for name in ("dumps", "compact", "indent"):
            assert walk_text(c, tok, texts[name]), (backend, name)
        assert not walk_text(c, tok, "{" + " " * 40 + texts["dumps"][1:]), backend


def test_layout_options_parsed():
    schema = {"type": "object"}
    assert spec_from_request({"guided_json": schema}).json_layout == "dumps"
    assert spec_from_request({"guided_json": schema}).options == {}
    so = spec_from_request({"structured_outputs": {"json": schema, "json_layout": "flexible"}})
    assert so.json_layout == "flexible" and so.options == {"json_layout": "flexible"}
    rf = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "json_layout": "compact"}}})
    assert rf.options == {"json_layout": "compact"}
    dumps = spec_from_request({"structured_outputs": {"json": schema, "json_layout": "dumps"}})
    assert dumps.options == {} and dumps == spec_from_request({"guided_json": schema})
    off = spec_from_request({"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert off.options == {"json_layout": "compact"}
    obj = spec_from_request({"response_format": {"type": "json_object"},
                             "structured_outputs": {"json_layout": "compact"}})
    assert obj.kind == "json_object" and obj.json_layout == "compact"
    ws = spec_from_request({"guided_json": schema, "guided_whitespace_pattern": "[ ]?"})
    assert ws.json_layout == "flexible" and ws.options == {"whitespace_pattern": "[ ]?"}
    regex = spec_from_request({"structured_outputs": {"regex": "a", "json_layout": "compact"}})
    assert regex.options == {}


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"json": {}, "json_layout": "pretty"}}, "structured_outputs.json_layout"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "json_layout": 2}}},
     "response_format.json_schema.json_layout"),
    ({"structured_outputs": {"json": {}, "json_layout": "dumps", "disable_any_whitespace": True}},
     "structured_outputs.json_layout"),
    ({"structured_outputs": {"json": {}, "json_layout": "compact", "whitespace_pattern": " ?"}},
     "structured_outputs.json_layout"),
])
def test_bad_layout_is_a_400(fields, param):
    with pytest.raises(InvalidConstraintError) as info:
        spec_from_request(fields)
    assert info.value.param == param


def test_custom_whitespace_pattern(compiler, tok):
    c = compiler.compile(ConstraintSpec("json_schema", NESTED, {"whitespace_pattern": "[ ]?"}))
    instance = CASES[0][1]
    assert walk_text(c, tok, json.dumps(instance)) and walk_text(c, tok, json.dumps(instance, separators=(",", ":")))
    assert not walk_text(c, tok, json.dumps(instance, indent=2))
