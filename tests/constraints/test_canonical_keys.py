"""Object keys written one way only (constraints/backends/canonical_keys.py): an escaped spelling
of a listed name never gets past that name's schema; the escapes a key needs, and escaped
non-ASCII where no name or pattern could be spelled by it, are still written."""

from __future__ import annotations

import json
import random

import pytest

from constraints import ConstraintSpec
from constraints.backends.canonical_keys import Scan, scan_bytes

from .conftest import walk_text

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}
STRING_EXTRAS = {"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}


@pytest.mark.parametrize("layout", ["dumps", "flexible"])
@pytest.mark.parametrize("schema", [OPEN, STRING_EXTRAS], ids=["open", "string-extras"])
def test_an_escaped_spelling_never_gets_past_a_listed_name(compiler, tok, schema, layout):
    """``"\\u0061"`` is the key ``a``: llguidance took it for an unlisted key, and let a string
    through where ``a`` must be an integer."""
    compiled = compiler.compile(ConstraintSpec("json_schema", schema, {"json_layout": layout}))
    sep = ": " if layout == "dumps" else ":"
    assert walk_text(compiled, tok, '{"a"' + sep + "1}")
    assert walk_text(compiled, tok, '{"b"' + sep + '"x"}')
    for key in ("\\u0061", "\\u0041", "\\/"):  # an ASCII character escaped: never its spelling
        assert not walk_text(compiled, tok, '{"' + key + '"' + sep + '"x"}'), key


@pytest.mark.parametrize(("text", "kept"), [
    ('{"a\\"b": "x"}', True), ('{"a\\\\b": "x"}', True), ('{"a\\n": "x"}', True),
    ('{"a\\u0001": "x"}', True), ('{"a\\u001f": "x"}', True),
    ('{"a\\u000a": "x"}', False), ('{"a\\u001F": "x"}', False), ('{"a\\u0022b": "x"}', False),
])
def test_keys_keep_the_escapes_they_need(compiler, tok, text, kept):
    compiled = compiler.compile(ConstraintSpec("json_schema", STRING_EXTRAS))
    assert walk_text(compiled, tok, text) == kept


def test_escaped_non_ascii_only_where_it_spells_no_name(compiler, tok):
    """json.dumps writes ``"é"`` as ``"\\u00e9"``: kept where every name is ASCII and no pattern
    picks keys; written raw where a name holds it or a pattern matches keys as written."""
    ascii_names = compiler.compile(ConstraintSpec("json_schema", STRING_EXTRAS))
    assert walk_text(ascii_names, tok, '{"\\u00e9": "x"}') and walk_text(ascii_names, tok, '{"é": "x"}')
    for schema in ({"properties": {"é": {"type": "string"}}},
                   {"patternProperties": {"^[^a-z]$": {"type": "string"}}}):
        compiled = compiler.compile(ConstraintSpec("json_schema", schema))
        assert not walk_text(compiled, tok, '{"\\u00e9": 1}'), schema
        assert walk_text(compiled, tok, '{"é": "x"}'), schema
        assert walk_text(compiled, tok, '{"é": "\\u00e9"}'), schema  # a string value keeps its escapes


def test_every_key_json_dumps_writes_is_its_one_spelling():
    rng = random.Random(5)
    alphabet = ['a', 'é', '"', '\\', '\n', '\t', '\x01', '\x1f', '/', '\x7f', '😀', ' ']
    for _ in range(300):
        value = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))): [{"k": 1}]
                 for _ in range(rng.randint(1, 3))}
        text = json.dumps(value, ensure_ascii=False).encode()
        assert scan_bytes(Scan(), text) is not None, text


def test_a_token_that_goes_on_with_an_escape_is_refused_in_the_mask_too(compiler, tok):
    """After ``"\\u`` in a key, a token without a backslash (``0061``) may finish a spelling
    the rule refuses: the mask must refuse it as accept does (a sampled token is always taken)."""
    from .conftest import allowed_ids, new_mask

    compiled = compiler.compile(ConstraintSpec("json_schema", STRING_EXTRAS))
    matcher = compiled.new_matcher()
    for t in tok.encode('{"a\\u00', add_special_tokens=False):
        assert matcher.accept_token(t)
    mask = new_mask()
    matcher.fill_bitmask(mask, 0)
    for t in sorted(allowed_ids(mask))[:400]:
        probe = compiled.new_matcher()
        for u in tok.encode('{"a\\u00', add_special_tokens=False):
            probe.accept_token(u)
        assert probe.accept_token(t), tok.decode([t])
