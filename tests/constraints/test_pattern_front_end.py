"""One regex front end for every pattern (issue #30, item 1): JSON Schema ``pattern``,
``patternProperties`` and ``propertyNames``, the ``regex`` constraint and Lark terminals read
anchors, lookarounds, word boundaries and backreferences the ECMA-262 way, exactly or with a
refusal that names the construct and its offset (never a backend's raw parser error)."""

from __future__ import annotations

import itertools
import random

import pytest

from constraints import ConstraintSpec, EmptyLanguageError, InvalidConstraintError, UnsupportedConstraintError
from constraints.backends.messages import backend_message
from constraints.compile.planner import plan
from constraints.regex.frontend import full_regex, schema_pattern
from constraints.regex.syntax import scan

from .conftest import walk_json, walk_text


def _string(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


def _classify(compiler, tok, schema: dict, accepted: list, rejected: list) -> None:
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in accepted:
        assert walk_json(compiled, tok, value), value
    for value in rejected:
        assert not walk_json(compiled, tok, value), value


def _refusal(compiler, kind: str, source, error: type = UnsupportedConstraintError) -> str:
    with pytest.raises(error) as info:
        compiler.compile(ConstraintSpec(kind, source))
    message = info.value.message
    assert ".cc" not in message and "/project/" not in message, message
    return message


# -- anchors anywhere -----------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["a^b", "^a$b"])
def test_an_anchor_in_the_middle_empties_the_pattern_as_it_does_the_regex(compiler, pattern):
    assert "matches no string" in _refusal(compiler, "json_schema", _string(pattern), EmptyLanguageError)
    assert "matches no string" in _refusal(compiler, "regex", pattern, EmptyLanguageError)


def test_an_anchor_inside_one_alternative_constrains_that_alternative_only(compiler, tok):
    _classify(compiler, tok, _string("(^a|b)c"), ["ac", "acx", "bc", "xbc"], ["xac", "ab", "c", ""])


def test_anchors_too_costly_to_resolve_go_on_as_written_but_never_to_xgrammar():
    # [ab]*a[ab]{12}: a DFA of 2**12 states; xgrammar would drop the inner ^ (llguidance reads it)
    spec = ConstraintSpec("json_schema", _string("(?:^|-)[ab]*a[ab]{12}"))
    assert [attempt.backend for attempt in plan(spec)] == ["llguidance"]


def test_an_empty_pattern_leaves_the_other_types_and_optional_places_alone(compiler, tok):
    _classify(compiler, tok, {"anyOf": [_string("a^b"), {"type": "integer"}]}, [1], ["ab", "x"])
    optional = {"type": "object", "properties": {"a": _string("a^b")}}
    _classify(compiler, tok, optional, [{}], [{"a": "ab"}])
    required = {**optional, "required": ["a"]}
    message = _refusal(compiler, "json_schema", required, EmptyLanguageError)
    assert "a^b" in message and "/properties/a" in message and "matches no string" in message


# -- lookahead and lookbehind ---------------------------------------------------------------------


def test_a_lookahead_that_cannot_hold_empties_the_pattern(compiler):
    assert "matches no string" in _refusal(compiler, "json_schema", _string("^(?=a)b$"), EmptyLanguageError)


def test_a_negative_lookahead_is_enforced(compiler, tok):
    _classify(compiler, tok, _string("^(?!a)\\w$"), ["b", "_", "Z"], ["a", "ab", "-"])


def test_lookbehinds_are_enforced(compiler, tok):
    _classify(compiler, tok, _string("(?<=a)b"), ["ab", "xaby"], ["b", "ba", ""])
    _classify(compiler, tok, _string("^[a-z-]+(?<!-)$"), ["ab", "a-b"], ["ab-", "-"])


def test_a_lookahead_in_pattern_properties_is_enforced(compiler, tok):
    schema = {"type": "object", "patternProperties": {"^(?!x)[a-z]+$": {"type": "integer"}},
              "additionalProperties": False}
    _classify(compiler, tok, schema, [{}, {"ab": 1}], [{"xa": 1}, {"ab": "s"}])


def test_a_lookbehind_in_pattern_properties_is_enforced(compiler, tok):
    schema = {"type": "object", "patternProperties": {"(?<=_)id$": {"type": "integer"}}, "additionalProperties": False}
    _classify(compiler, tok, schema, [{"user_id": 1}], [{"userid": 1}, {"user_id": "x"}])


def test_lookarounds_in_property_names_are_enforced(compiler, tok):
    ahead = {"type": "object", "propertyNames": {"pattern": "^(?!x)[a-z]+$"}}
    _classify(compiler, tok, ahead, [{}, {"ab": 1}], [{"xa": 1}, {"AB": 1}])
    behind = {"type": "object", "propertyNames": {"pattern": "^[a-z_]+(?<!_)$"}}
    _classify(compiler, tok, behind, [{"a_b": 1}], [{"ab_": 1}])


def test_a_lookahead_too_large_to_write_is_refused_naming_it_and_its_offset(compiler):
    hostname = "^(?:(?!-)[A-Za-z0-9-]{1,63}(?<!-)\\.)+[A-Za-z]{2,}$"
    message = _refusal(compiler, "json_schema", {"type": "object", "properties": {"h": _string(hostname)}})
    assert "pattern at /properties/h" in message and "negative lookahead (?! at offset 4" in message


def test_several_lookaheads_are_enforced(compiler, tok):
    password = "^(?=.*[a-z])(?=.*[A-Z])(?=.*\\d).{8,}$"
    _classify(compiler, tok, _string(password), ["abcDEF12", "1aB-----"], ["abcdefgh", "abcDEFGH", "aB1"])


def test_a_lookahead_inside_a_lookbehind_is_refused_naming_both(compiler):
    message = _refusal(compiler, "json_schema", _string("(?<=(?=a))b"))
    assert "lookahead (?= at offset 4" in message and "lookbehind (?<= at offset 0" in message


# -- word boundaries ------------------------------------------------------------------------------


def test_word_boundaries_are_enforced(compiler, tok):
    _classify(compiler, tok, _string("\\bfoo\\b"), ["foo", "a foo", "foo-bar"], ["afoo", "foob", "fo o"])
    _classify(compiler, tok, _string("^x\\By$"), ["xy"], ["x y", "x-y"])


def test_a_word_boundary_between_two_word_characters_empties_the_pattern(compiler):
    message = _refusal(compiler, "json_schema", _string("^x\\by$"), EmptyLanguageError)
    assert "matches no string" in message and "regex_converter" not in message


def test_word_boundaries_in_a_regex_are_enforced(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("regex", "a\\b-|x\\By"))
    assert walk_text(compiled, tok, "a-") and walk_text(compiled, tok, "xy")
    assert not walk_text(compiled, tok, "x y")


def test_a_quantified_word_boundary_is_refused_naming_it(compiler):
    message = _refusal(compiler, "regex", "a\\b*", InvalidConstraintError)
    assert "word boundary \\b at offset 1" in message


# -- backreferences and backend errors --------------------------------------------------------------


@pytest.mark.parametrize(("kind", "source", "named"), [
    ("json_schema", _string("(a)\\1"), "backreference \\1 at offset 3"),
    ("regex", "(a)\\1", "backreference \\1 at offset 3"),
    ("json_schema", {"type": "object", "patternProperties": {"(?<x>a)\\k<x>": {}}}, "backreference \\k<x> at offset 7"),
])
def test_a_backreference_is_refused_naming_it(compiler, kind, source, named):
    assert named in _refusal(compiler, kind, source)


@pytest.mark.parametrize(("kind", "source"), [
    ("json_schema", _string("a(b")),
    ("regex", "a(b"),
    ("grammar_ebnf", 'root ::= "a" ('),
])
def test_a_backend_parser_error_reaches_the_client_without_source_paths(compiler, kind, source):
    _refusal(compiler, kind, source, InvalidConstraintError)


def test_backend_messages_lose_timestamps_and_source_paths():
    xgrammar = ("[12:30:27] /project/cpp/regex_converter.cc:83: Regex parsing error at position 3: "
                "Word boundary is not supported yet.")
    assert backend_message(xgrammar) == "Regex parsing error at position 3: Word boundary is not supported yet."
    llguidance = "regex parse error:\n    a(b\n     ^\nerror: unclosed group"
    assert backend_message(llguidance) == "regex parse error at position 1: unclosed group"


def test_a_lookaround_in_a_lark_terminal_is_refused_naming_it(compiler):
    message = _refusal(compiler, "grammar_lark", 'start: /a(?=b)/ "b"')
    assert "/a(?=b)/" in message and "lookahead (?= at offset 1" in message


# -- the front end itself, against a reference engine -----------------------------------------------


def test_scan_finds_each_construct_at_its_offset():
    found = [(c.text, c.start) for c in scan("^a(?<=a)\\b[\\b^$](?!x)\\1$").constructs]
    assert found == [("^", 0), ("(?<=", 2), ("\\b", 8), ("(?!", 16), ("\\1", 21), ("$", 23)]


_TEXTS = [""] + ["".join(p) for n in range(1, 5) for p in itertools.product("ab- ", repeat=n)]
_PATTERNS = ["(^a|b)-", "a$|^b", "(?<=a)b", "(?<!a)b$", "\\bab\\b", "\\B-", "(?=\\w*b)\\w{2}", "^(?!.*--)[a-z-]+$",
             "(?<=^a)b", "(?:a|b(?=-))+$", "(?<=a|b-)a", "(?=(?!a)\\w)", "^(?!^a|b)", "(?<=\\ba)-", "x(?=\\Bab)|a\\b"]


def _agree(reference, pattern: str) -> None:
    expected = reference.compile(pattern, reference.ASCII | reference.V0)
    found = schema_pattern(pattern)
    written = None if found is None else reference.compile(found, reference.ASCII | reference.V0)
    for text in _TEXTS:
        assert bool(expected.search(text)) == bool(written and written.search(text)), (pattern, text, found)
    try:
        whole = reference.compile(full_regex(pattern), reference.ASCII | reference.V0)
    except EmptyLanguageError:
        whole = None
    for text in _TEXTS:
        assert bool(expected.fullmatch(text)) == bool(whole and whole.fullmatch(text)), (pattern, text)


@pytest.mark.parametrize("pattern", _PATTERNS)
def test_the_front_end_matches_what_an_ecma_engine_matches(pattern):
    _agree(pytest.importorskip("regex"), pattern)


def test_random_regexes_match_what_an_ecma_engine_matches():
    reference = pytest.importorskip("regex")
    rng = random.Random(30)
    atoms = ["a", "b", "-", "\\w", "\\W", ".", "[ab]", "[^a]", "^", "$", "\\b", "\\B"]

    def regex(depth: int) -> str:
        roll = rng.random()
        if depth == 0 or roll < 0.3:
            return rng.choice(atoms)
        if roll < 0.5:
            return regex(depth - 1) + regex(depth - 1)
        if roll < 0.6:
            return f"(?:{regex(depth - 1)}|{regex(depth - 1)})"
        if roll < 0.7:
            return f"(?:{regex(depth - 1)}){rng.choice(['*', '+', '?', '{1,2}'])}"
        return f"({rng.choice(['?=', '?!', '?<=', '?<!'])}{regex(depth - 1)})"

    checked = 0
    while checked < 60:
        pattern = regex(3)
        try:
            reference.compile(pattern, reference.V0)
            _agree(reference, pattern)
        except (reference.error, UnsupportedConstraintError, InvalidConstraintError):
            continue  # not a regex, or a nesting the front end refuses
        checked += 1
