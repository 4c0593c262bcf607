"""oneOf made exclusive part by part (constraints/schema/one_of_parts.py, tag_split.py,
way_sets.py, and the negations they lean on): an instance matching two branches is refused, one
matching a single branch accepted (MaskBench Github_medium o35868, o72203, o9802, Github_hard
o36016, o84330, o3895, Github_easy o90313)."""

from __future__ import annotations

from constraints.regex.disjoint import patterns_disjoint
from constraints.schema.analysis import rewrite_schema
from constraints.schema.formats import format_keywords
from constraints.schema.negation import negate
from constraints.schema.one_of_parts import exclusive_parts, overlap_groups
from constraints.schema.tag_split import split_on_tag
from constraints.schema.tree import subschemas
from constraints.schema.way_sets import merged_values, minimal_combinations

from .conftest import assert_classified


def _one_of_left(schema: dict) -> bool:
    return any(isinstance(n, dict) and "oneOf" in n for _, n in subschemas(rewrite_schema(schema)))


# -- optional tags -----------------------------------------------------------------------------

def _reward(kind: str, extra: str) -> dict:
    return {"properties": {"type": {"enum": [kind]}, "unit": {"type": "string"}, extra: {"type": "string"}}}


TAGGED = {"type": "object", "oneOf": [_reward("credit", "code"), _reward("gift", "name"), _reward("fuel", "code")]}


def test_an_optional_tag_splits_the_objects(compiler, tok):
    """With "type" an object matches the one branch naming it; without, "credit" and "fuel"
    say the same, so an untagged object matches one branch only through "name" with a value
    the others reject... and never, since the others take any "name": {"name": "x"} matches
    all three."""
    assert not _one_of_left(TAGGED)
    assert_classified(compiler, tok, TAGGED,
                      valid=[{"type": "credit", "code": "a"}, {"type": "gift", "name": "b"}, {"type": "fuel"}],
                      invalid=[{}, {"code": "a"}, {"name": "x"}, {"type": "other"}, {"type": "gift", "name": 1},
                               {"unit": "u"}, "credit"])


def test_untagged_objects_that_match_one_branch_stay():
    """Closed branches: without the tag, a key one branch alone lists picks it."""
    closed = [{"type": "object", "additionalProperties": False,
               "properties": {"type": {"enum": [k]}, "label": {"type": "string"}, **extra}}
              for k, extra in (("text", {"placeholder": {"type": "string"}}), ("static", {}))]
    form = split_on_tag(closed, {}, {})
    assert form is not None
    import jsonschema

    check = jsonschema.Draft202012Validator({"anyOf": form["anyOf"]}).is_valid
    assert check({"type": "text", "label": "a"}) and check({"type": "static"}) and check({"placeholder": "p"})
    assert not check({"label": "a"}) and not check({}) and not check({"type": "static", "placeholder": "p"})


def test_no_tag_no_split():
    """A literal property shared by two branches, or missing from one, is no tag."""
    assert split_on_tag([{"properties": {"t": {"enum": ["a", "b"]}}}, {"properties": {"t": {"const": "b"}}}],
                        {}, {"type": "object"}) is None
    assert split_on_tag([{"properties": {"t": {"const": "a"}}}, {"properties": {"u": {"const": "b"}}}],
                        {}, {"type": "object"}) is None


COUNTRIES = {"type": "object", "oneOf": [
    *({"properties": {"country": {"enum": [c]}, "state": {"type": "string", "enum": states},
                      "zip": {"type": "string", "maxLength": 5}}}
      for c, states in (("BRA", ["AC", "AL"]), ("ITA", ["AG", "AL"]), ("MEX", ["BC", "CM"]))),
    {"properties": {"country": {"enum": ["OTHER"]}, "state": {"type": "string"}, "zip": {"type": "string"}}},
]}


def test_ways_on_one_listed_property_are_merged(compiler, tok):
    """Without "country", the catch-all branch fails each listed one by a state outside that
    list, or by a long zip: two copies, not 2^3, the three state lists negated as one. A listed
    state or a short zip alone matches the catch-all too."""
    assert not _one_of_left(COUNTRIES)
    assert_classified(compiler, tok, COUNTRIES,
                      valid=[{"country": "BRA"}, {"state": "XX"}, {"zip": "1234567"},
                             {"country": "OTHER", "state": "AL"}, {"country": "MEX", "state": "CM"}],
                      invalid=[{}, {"state": "AC"}, {"state": "CM"}, {"state": "AL"}, {"zip": "1"},
                               {"country": "BRA", "state": "BC"}, {"country": "XXX"}])


def test_minimal_combinations():
    """One way per list; a way that fails several lists is written once; supersets dropped."""
    common = {"p": 1}
    combos = minimal_combinations([[{"s": i}, common] for i in range(9)], 16)
    assert combos is not None and len(combos) == 2 and [common] in combos
    assert minimal_combinations([[{"a": 1}, {"b": 1}], [{"c": 1}, {"d": 1}], [{"e": 1}, {"f": 1}]], 4) is None
    assert minimal_combinations([], 4) == [[]]


def test_merged_values_unions_literal_lists():
    ways = [{"required": ["s"], "properties": {"s": negate({"enum": ["a"]}, {})}},
            {"required": ["s"], "properties": {"s": negate({"enum": ["b"]}, {})}}, {"properties": {"r": False}}]
    import json

    sources = {json.dumps(ways[0], sort_keys=True): {"enum": ["a"]}, json.dumps(ways[1], sort_keys=True): {"enum": ["b"]}}
    merged = merged_values(ways, sources, {})
    assert merged[0] == {"properties": {"r": False}}
    assert merged[1] == {"required": ["s"], "properties": {"s": negate({"enum": ["a", "b"]}, {})}}


# -- flattened allOf branches, a branch inside another ------------------------------------------

METERS = {"definitions": {"meter": {"type": "object", "properties": {"enabled": {"type": "boolean"}},
                                    "required": ["enabled"]}},
          "type": "object", "oneOf": [
              {"allOf": [{"$ref": "#/definitions/meter"}, {"properties": {"protocol": {"enum": ["invalid"]}}}]},
              {"allOf": [{"$ref": "#/definitions/meter"}, {"properties": {"protocol": {"enum": ["s0"]},
                                                                            "gpio": {"type": "string"}}}]},
              {"allOf": [{"$ref": "#/definitions/meter"}, {"properties": {"protocol": {"enum": ["d0"]},
                                                                            "host": {"type": "string"}}}]}]}


def test_allof_branches_over_a_shared_base(compiler, tok):
    """Without "protocol" every meter matches the "invalid" branch and another: refused."""
    assert not _one_of_left(METERS)
    assert_classified(compiler, tok, METERS,
                      valid=[{"enabled": True, "protocol": "s0", "gpio": "a"}, {"enabled": False, "protocol": "invalid"}],
                      invalid=[{"enabled": True}, {"enabled": True, "gpio": "a"}, {"protocol": "s0"},
                               {"enabled": True, "protocol": "d0", "host": 1}])


# -- overlap groups and untyped object branches -------------------------------------------------

def test_overlap_groups():
    branches = [{"type": "null"}, {"type": "string"}, {"type": "string", "maxLength": 2}, {"type": "integer"}]
    assert overlap_groups(branches, {}, {}) == [[0], [1, 2], [3]]


def test_groups_made_exclusive_apart():
    """null stands alone; the two strings become "short" and "long" (exactly_one)."""
    branches = [{"type": "null"}, {"type": "string"}, {"type": "string", "maxLength": 2}]
    form = exclusive_parts(branches, {}, {})
    assert form is not None
    import jsonschema

    check = jsonschema.Draft202012Validator(form).is_valid
    assert check(None) and check("long")
    assert not check("ab") and not check(1)


UNTYPED = {"oneOf": [
    {"properties": {"kind": {"const": "sum"}, "rules": {"type": "string"}}},
    {"properties": {"kind": {"const": "count"}}},
    {"properties": {"kind": {"const": "first"}}},
]}


def test_untyped_object_branches_refuse_every_non_object(compiler, tok):
    """Every non-object matches all three branches; an object without "kind" matches "count"
    and "first" alike."""
    assert not _one_of_left(UNTYPED)
    assert_classified(compiler, tok, UNTYPED,
                      valid=[{"kind": "sum", "rules": "a"}, {"kind": "count", "rules": 1}],
                      invalid=[1, "a", None, [], {}, {"rules": "a"}, {"kind": "sum", "rules": 1}, {"kind": "x"}])


# -- negations: a reference beside annotations, a nested oneOf -----------------------------------

def test_negate_follows_a_reference_beside_annotations():
    root = {"definitions": {"a": {"type": "string"}}}
    neg = negate({"$ref": "#/definitions/a", "description": "d"}, root)
    assert neg == negate({"type": "string"}, root)
    assert negate({"$ref": "http://example.com/x", "description": "d"}, root) is None


def test_negate_a_nested_one_of():
    import jsonschema

    disjoint = {"oneOf": [{"type": "string"}, {"type": "null"}]}
    neg = negate(disjoint, {})
    check = jsonschema.Draft202012Validator(neg).is_valid
    assert check(1.5) and check([]) and not check("a") and not check(None)
    overlapping = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 1}]}
    neg = negate(overlapping, {})
    check = jsonschema.Draft202012Validator(neg).is_valid
    assert check("a") and check(None) and not check("ab")


# -- long patterns ------------------------------------------------------------------------------

def test_a_long_pattern_against_a_short_one():
    """The uri format's pattern (over 2,000 characters) against a relative path or a host name."""
    uri = format_keywords("uri")["pattern"]
    assert patterns_disjoint(uri, r"^\./.+$")
    assert patterns_disjoint(uri, format_keywords("hostname")["pattern"])
    assert not patterns_disjoint(uri, r"^https:")


# the uri format's own pattern: jsonschema asserts a pattern without a format checker
URL_OR_PATH = {"type": "string", "oneOf": [{"pattern": format_keywords("uri")["pattern"]}, {"pattern": r"^\./.+$"}]}


def test_uri_or_relative_path(compiler, tok):
    assert not _one_of_left(URL_OR_PATH)
    assert_classified(compiler, tok, URL_OR_PATH, valid=["https://a.b/c", "./x"], invalid=["x", "./", 1])


def test_negate_skips_a_format_no_draft_defines():
    """``format: mongoId`` asserts nothing: its negation is that of the rest of the schema."""
    assert negate({"type": "string", "format": "mongoId"}, {}) == negate({"type": "string"}, {})
    assert negate({"type": "string", "format": "date-time"}, {}) is None  # a defined format: no exact complement here


def test_equal_numbers_written_apart_are_no_discriminator():
    """1 and 1.0 are one JSON Schema value: branches listing them are not disjoint (the oneOf
    over them accepts nothing), and no tag; 1 and true stay apart."""
    import jsonschema

    form = rewrite_schema({"oneOf": [{"const": 1}, {"const": 1.0}]})
    assert not jsonschema.Draft202012Validator(form).is_valid(1)
    tagged = [{"properties": {"t": {"const": 1}}}, {"properties": {"t": {"const": 1.0}}}]
    assert split_on_tag(tagged, {}, {"type": "object"}) is None
    from constraints.schema.way_sets import _literal_union

    assert _literal_union([{"enum": [1, "a"]}, {"enum": [True, 1.0]}], {}) == {"enum": [1.0, "a", True]}


RPC = {"definitions": {
    "common": {"type": "object", "required": ["id"], "not": {"required": ["result", "error"]}},
    "success": {"allOf": [{"$ref": "#/definitions/common"}, {"required": ["result"]}]},
    "error": {"allOf": [{"$ref": "#/definitions/common"}, {"required": ["error"]}]}},
    "oneOf": [{"$ref": "#/definitions/success"}, {"$ref": "#/definitions/error"}]}


def test_branches_that_a_shared_part_keeps_apart(compiler, tok):
    """Each branch requires a key and their shared part rules out having both: disjoint
    (MaskBench Github_easy o90953, JSON-RPC responses)."""
    assert not _one_of_left(RPC)
    assert_classified(compiler, tok, RPC, valid=[{"id": 1, "result": 2}, {"id": 1, "error": 3}],
                      invalid=[{"id": 1, "result": 2, "error": 3}, {"id": 1}, {"result": 2}, []])
