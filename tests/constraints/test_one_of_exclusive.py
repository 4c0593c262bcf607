"""oneOf proven exclusive in more places (constraints/schema/disjoint.py), so it is enforced as
anyOf: listed values checked against the other branch, a discriminating property that the
keywords beside the oneOf require (or another allOf part of the branch), property values of
disjoint types, alternatives (anyOf) each disjoint from the other branch, and discriminated
unions where only some branches leave out ``type: object``. Each case also has a neighbour
where the branches do overlap, whose shared instances must still be rejected (MaskBench
JsonSchemaStore testenvironments, plagiarize-me, bundleconfig, vtestunit, cityjson,
mason-registry, zapp)."""

from __future__ import annotations

import jsonschema

from constraints import UnsupportedConstraintError
from constraints.schema.analysis import rewrite_schema
from constraints.schema.disjoint import objects_only_disjoint, pairwise_disjoint

from .conftest import assert_classified


def _one_of_left(schema: dict) -> bool:
    from constraints.schema.tree import subschemas

    return any(isinstance(n, dict) and "oneOf" in n for _, n in subschemas(rewrite_schema(schema)))


def _same_language(schema: dict, values: list) -> None:
    """The rewrite accepts exactly what the schema accepts, on ``values``."""
    out = rewrite_schema(schema)
    check, got = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(out)
    for value in values:
        assert got.is_valid(value) == check.is_valid(value), value


LITERAL_VS_PATTERN = {"type": "string", "oneOf": [{"enum": ["Roof"]}, {"enum": ["Door"]},
                                                  {"type": "string", "pattern": "^\\+[a-z]+$"}]}


def test_listed_values_no_other_branch_takes(compiler, tok):
    assert not _one_of_left(LITERAL_VS_PATTERN)
    assert_classified(compiler, tok, LITERAL_VS_PATTERN, valid=["Roof", "Door", "+abc"],
                      invalid=["Roofx", "+Roof", "", "roof", 3])


def test_a_listed_value_the_other_branch_takes_is_not_exclusive(compiler, tok):
    schema = {"type": "string", "oneOf": [{"enum": ["+ab", "x"]}, {"pattern": "^\\+[a-z]+$"}]}
    assert not pairwise_disjoint(schema["oneOf"], schema, {"type": "string"})
    _same_language(schema, ["+ab", "x", "+abc", "y", "+"])
    try:
        assert_classified(compiler, tok, schema, valid=["x", "+abc"], invalid=["+ab", "y"])
    except UnsupportedConstraintError as exc:  # refused by name is fine; accepting "+ab" is not
        assert "oneOf" in str(exc), exc


REQUIRED_BESIDE = {
    "type": "object",
    "required": ["kind"],
    "oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "string"}}},
              {"properties": {"kind": {"const": "b"}}}],
}


def test_discriminator_required_beside_the_one_of(compiler, tok):
    assert pairwise_disjoint(REQUIRED_BESIDE["oneOf"], REQUIRED_BESIDE, {"type": "object", "required": ["kind"]})
    assert not _one_of_left(REQUIRED_BESIDE)
    assert_classified(compiler, tok, REQUIRED_BESIDE, valid=[{"kind": "a"}, {"kind": "b", "x": 1}, {"kind": "a", "x": "s"}],
                      invalid=[{}, {"kind": "c"}, {"x": "s"}, {"kind": "a", "x": 1}, "a"])


def test_without_the_required_discriminator_an_object_matches_both():
    """{"x": "s"} has no kind: it matches both branches, so oneOf rejects it."""
    schema = {k: v for k, v in REQUIRED_BESIDE.items() if k != "required"}
    assert not pairwise_disjoint(schema["oneOf"], schema, {"type": "object"})
    _same_language(schema, [{"x": "s"}, {"kind": "a"}, {"kind": "b"}, {}, {"kind": "c"}])


VERSIONED = {
    "type": "object",
    "$defs": {"v1": {"type": "object", "required": ["v"], "properties": {"v": {"type": "string"}, "a": {}}},
              "v2": {"type": "object", "required": ["v"], "properties": {"v": {"type": "string"}, "b": {}}}},
    "oneOf": [{"allOf": [{"properties": {"v": {"const": "1"}}}, {"$ref": "#/$defs/v1"}]},
              {"allOf": [{"properties": {"v": {"const": "2"}}}, {"$ref": "#/$defs/v2"}]}],
}


def test_discriminator_required_in_another_all_of_part(compiler, tok):
    assert not _one_of_left(VERSIONED)
    assert_classified(compiler, tok, VERSIONED, valid=[{"v": "1"}, {"v": "2", "b": 0}, {"v": "1", "a": [], "b": 1}],
                      invalid=[{}, {"v": "3"}, {"a": 1}, {"v": 1}])


MACHINE = {"oneOf": [{"type": "object", "required": ["m"], "properties": {"m": {"type": "object"}}},
                     {"type": "object", "required": ["m"], "properties": {"m": {"type": "boolean"}}}]}


def test_required_property_values_of_disjoint_types(compiler, tok):
    assert not _one_of_left(MACHINE)
    assert_classified(compiler, tok, MACHINE, valid=[{"m": {}}, {"m": True}, {"m": {"a": 1}}],
                      invalid=[{"m": 1}, {}, {"m": None}, [], "m"])


def test_an_optional_property_does_not_separate_branches():
    """Without ``required``, {} matches both branches."""
    schema = {"oneOf": [{"type": "object", "properties": {"m": {"type": "object"}}},
                        {"type": "object", "properties": {"m": {"type": "boolean"}}}]}
    assert not pairwise_disjoint(schema["oneOf"], schema)
    _same_language(schema, [{}, {"m": {}}, {"m": True}, {"m": 1}])


BUNDLE = {
    "required": ["f"],
    "properties": {"f": {"type": "string"}},
    "oneOf": [{"properties": {"f": {"pattern": "\\.js$"}}}, {"properties": {"f": {"pattern": "\\.css$"}}}],
}


def test_property_type_beside_the_one_of_makes_patterns_exclusive(compiler, tok):
    assert not _one_of_left(BUNDLE)
    assert_classified(compiler, tok, BUNDLE, valid=[{"f": "a.js"}, {"f": "b.css"}, {"f": ".js", "g": 1}],
                      invalid=[{"f": "a.txt"}, {"f": 1}, {}, 5, "a.js"])


def test_patterns_alone_do_not_exclude_a_non_string_value():
    """Without ``type: string`` beside, {"f": 1} matches both branches."""
    schema = {k: v for k, v in BUNDLE.items() if k != "properties"}
    assert not objects_only_disjoint(schema["oneOf"], schema, {"required": ["f"]})
    _same_language(schema, [{"f": 1}, {"f": "a.js"}, {"f": "a.css"}, {}, 5])


SOME_UNTYPED = {"oneOf": [{"required": ["t"], "properties": {"t": {"enum": ["a"]}}},
                          {"required": ["t"], "properties": {"t": {"enum": ["b"]}}},
                          {"type": "object", "required": ["t"], "properties": {"t": {"enum": ["c"]}}}]}


def test_two_untyped_branches_reject_every_non_object(compiler, tok):
    assert not _one_of_left(SOME_UNTYPED)
    assert_classified(compiler, tok, SOME_UNTYPED, valid=[{"t": "a"}, {"t": "b"}, {"t": "c", "u": 1}],
                      invalid=[5, "s", None, [], {"t": "d"}, {}])


def test_one_untyped_branch_takes_every_non_object(compiler, tok):
    """5 matches the untyped branch only: it is valid, so no ``type: object`` may be added."""
    schema = {"oneOf": [SOME_UNTYPED["oneOf"][0], SOME_UNTYPED["oneOf"][2]]}
    assert not objects_only_disjoint(schema["oneOf"], schema)
    _same_language(schema, [5, "s", {"t": "a"}, {"t": "c"}, {"t": "b"}, {}])
    assert_classified(compiler, tok, schema, valid=[5, "s", {"t": "a"}, {"t": "c"}], invalid=[{"t": "b"}, {}])


ALTERNATIVES = {"oneOf": [{"type": "object", "required": ["id"], "properties": {"id": {"const": "x"}}},
                          {"anyOf": [{"type": "object", "required": ["id"], "properties": {"id": {"const": "y"}}},
                                     {"type": "string"}]}]}


def test_each_alternative_disjoint_from_the_other_branch(compiler, tok):
    assert not _one_of_left(ALTERNATIVES)
    assert_classified(compiler, tok, ALTERNATIVES, valid=[{"id": "x"}, {"id": "y"}, "s"],
                      invalid=[{"id": "z"}, 1, {}, None])


def test_an_alternative_overlapping_the_other_branch():
    schema = {"oneOf": [ALTERNATIVES["oneOf"][0],
                        {"anyOf": [ALTERNATIVES["oneOf"][1]["anyOf"][0], {"type": "object"}]}]}
    assert not pairwise_disjoint(schema["oneOf"], schema)
    _same_language(schema, [{"id": "x"}, {"id": "y"}, {}, {"id": "z"}, "s"])


def test_format_branch_and_a_listed_value(compiler, tok):
    """zapp: ``oneOf: [{format: uri}, {enum: ["."]}]``: "." is no URI."""
    from constraints import ConstraintSpec

    from .conftest import walk_json

    schema = {"type": "string", "oneOf": [{"format": "uri"}, {"enum": ["."]}]}
    assert not _one_of_left(schema)
    check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    for value in ["https://example.com/a", "."]:
        assert check(value) and walk_json(compiled, tok, value), value
    for value in ["a b", 1, ".."]:
        assert not walk_json(compiled, tok, value), value


# closed branches behind $ref, wrapped with the type beside the oneOf: the closed part of one
# branch forbids a property the other requires (MaskBench Github_hard o14390, o39210)
CHANGELOG = {
    "type": "object",
    "definitions": {
        "added": {"type": "object", "additionalProperties": False, "required": ["p", "new"],
                  "properties": {"p": {"type": "string"}, "new": {"type": "string"}}},
        "deleted": {"type": "object", "additionalProperties": False, "required": ["p", "old"],
                    "properties": {"p": {"type": "string"}, "old": {"type": "string"}}},
        "modified": {"type": "object", "additionalProperties": False, "required": ["p", "old", "new"],
                     "properties": {"p": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}},
    },
    "oneOf": [{"$ref": "#/definitions/added"}, {"$ref": "#/definitions/deleted"}, {"$ref": "#/definitions/modified"}],
}


def test_closed_branch_behind_a_ref_forbids_what_the_other_requires(compiler, tok):
    assert pairwise_disjoint(CHANGELOG["oneOf"], CHANGELOG, {"type": "object"})
    assert not _one_of_left(CHANGELOG)
    assert_classified(compiler, tok, CHANGELOG,
                      valid=[{"p": "a", "new": "b"}, {"p": "a", "old": "b"}, {"p": "a", "old": "b", "new": "c"}],
                      invalid=[{}, {"p": "a"}, {"new": "b"}, {"p": "a", "new": "b", "x": 1}, {"p": 1, "new": "b"}])


def test_an_open_branch_does_not_forbid():
    """Without additionalProperties: false on ``added``, {"p", "old", "new"} matches two branches."""
    defs = {**CHANGELOG["definitions"], "added": {k: v for k, v in CHANGELOG["definitions"]["added"].items()
                                                  if k != "additionalProperties"}}
    schema = {**CHANGELOG, "definitions": defs}
    assert not pairwise_disjoint(schema["oneOf"], schema, {"type": "object"})
    _same_language(schema, [{"p": "a", "new": "b"}, {"p": "a", "old": "b", "new": "c"}, {"p": "a", "old": "b"}])


# closed objects with no property name in common share {} alone (Github_hard o3905, o23555)
OVERRIDES = {"oneOf": [{"type": "object", "additionalProperties": False,
                        "properties": {"e.domain": {"type": "string"}, "e.port": {"type": "string"}}},
                       {"type": "object", "additionalProperties": False,
                        "properties": {"p.encoded": {"type": "string"}}}]}


def test_closed_objects_sharing_only_the_empty_object(compiler, tok):
    """{} matches both branches, so oneOf rejects it; every other object matches one at most."""
    assert not pairwise_disjoint(OVERRIDES["oneOf"], OVERRIDES)
    assert pairwise_disjoint(OVERRIDES["oneOf"], OVERRIDES, empty_object=True)
    assert not _one_of_left(OVERRIDES)
    values = [{}, {"e.domain": "x"}, {"e.domain": "x", "e.port": "1"}, {"p.encoded": "y"},
              {"e.domain": "x", "p.encoded": "y"}, {"q": 1}, "s", None, {"e.port": 1}]
    _same_language(OVERRIDES, values)
    assert_classified(compiler, tok, OVERRIDES,
                      valid=[{"e.domain": "x"}, {"e.domain": "x", "e.port": "1"}, {"p.encoded": "y"}],
                      invalid=[{}, {"e.domain": "x", "p.encoded": "y"}, {"q": 1}, "s", None, {"e.port": 1}])


def test_the_empty_object_one_branch_accepts_stays_valid(compiler, tok):
    """When only one branch accepts {} (the other requires a name), {} is valid."""
    schema = {"oneOf": [OVERRIDES["oneOf"][0], {**OVERRIDES["oneOf"][1], "required": ["p.encoded"]}]}
    assert not _one_of_left(schema)
    _same_language(schema, [{}, {"e.domain": "x"}, {"p.encoded": "y"}, {"e.domain": "x", "p.encoded": "y"}])
    assert_classified(compiler, tok, schema, valid=[{}, {"e.domain": "x"}, {"p.encoded": "y"}],
                      invalid=[{"e.domain": "x", "p.encoded": "y"}, {"q": 1}, 1])


# untyped closed branches (objects only): every non-object matches both and is rejected; {} too
UNTYPED_CLOSED = {"oneOf": [{"additionalProperties": False, "properties": {"value": {"type": "number"}, "sym": {}}},
                            {"additionalProperties": False, "properties": {"string": {"type": "string"}}}]}


def test_untyped_closed_branches_sharing_only_the_empty_object(compiler, tok):
    assert not _one_of_left(UNTYPED_CLOSED)
    _same_language(UNTYPED_CLOSED, [{}, {"value": 1}, {"string": "s"}, {"value": 1, "string": "s"}, 3, "s", []])
    assert_classified(compiler, tok, UNTYPED_CLOSED, valid=[{"value": 1}, {"value": 1, "sym": "$"}, {"string": "s"}],
                      invalid=[{}, {"value": 1, "string": "s"}, 3, "s", [], None, {"value": "1"}])


def test_a_name_in_common_is_more_than_the_empty_object():
    """Both list ``id``: {"id": 1} matches both branches, and is not the only shared object."""
    schema = {"oneOf": [{"type": "object", "additionalProperties": False, "properties": {"id": {}, "a": {}}},
                        {"type": "object", "additionalProperties": False, "properties": {"id": {}, "b": {}}}]}
    assert not pairwise_disjoint(schema["oneOf"], schema, empty_object=True)
    _same_language(schema, [{}, {"id": 1}, {"a": 1}, {"b": 1}, {"id": 1, "a": 1}])


def test_a_branch_with_unknown_keywords_still_lets_every_non_object_through():
    """``name`` is no keyword: the branch constrains objects only, like the other."""
    schema = {"oneOf": [{"name": "x", "required": ["a"], "properties": {"a": {"const": 1}}},
                        {"name": "y", "required": ["a"], "properties": {"a": {"const": 2}}}]}
    assert objects_only_disjoint(schema["oneOf"], schema)
    assert not _one_of_left(schema)
    _same_language(schema, [{"a": 1}, {"a": 2}, {"a": 3}, {}, "s", 1, None])


def test_overlapping_patterns_of_counted_length_by_their_complements(compiler, tok):
    """Overlapping branches: exactly one holds, through each pattern's complement (DFAs of
    25-30 states, over the 24 the complement writer once stopped at)."""
    hex_id = {"oneOf": [{"type": "string", "pattern": "^[A-Fa-f0-9]{24}$"}, {"type": "string"}]}
    assert_classified(compiler, tok, hex_id, valid=["abc", "", "g" * 24, "a" * 25], invalid=["a" * 24, "0123456789abcdef01234567"])
    uuid = {"type": "string", "oneOf": [{"pattern": "^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$"},
                                        {"pattern": "^[0-9A-F]{8}-([0-9A-F]{4}-){3}[0-9A-F]{12}$"}]}
    lower, upper = "0a1b2c3d-0a1b-0a1b-0a1b-0a1b2c3d4e5f", "0A1B2C3D-0A1B-0A1B-0A1B-0A1B2C3D4E5F"
    digits = "01234567-0123-0123-0123-012345678901"  # both cases at once: matches both branches
    assert_classified(compiler, tok, uuid, valid=[lower, upper], invalid=[digits, "x", lower.upper()[:-1] + "f"])


# composer.json's repositories (MaskBench Github_ultra o21840 and its copies): a repository
# object requiring "type" and "url", or {"packagist.org": false}, one key whose value is false
def _repositories(disabled: dict) -> dict:
    repository = {"type": "object", "required": ["type", "url"],
                  "properties": {"type": {"type": "string", "enum": ["vcs", "git"]}, "url": {"type": "string"}}}
    return {"type": "array", "items": {"oneOf": [repository, {"type": "object", **disabled}]}}


def test_a_required_value_the_other_branch_takes_as_an_additional_property(compiler, tok):
    """An object of both would have a "type" that is a string and false."""
    schema = _repositories({"additionalProperties": {"type": "boolean", "enum": [False]}})
    assert pairwise_disjoint(schema["items"]["oneOf"], schema)
    assert not _one_of_left(schema)
    assert_classified(compiler, tok, schema,
                      valid=[[{"type": "git", "url": "u"}, {"packagist.org": False}], [{"x": False, "y": False}]],
                      invalid=[[{"type": "git"}], [{"packagist.org": True}], [{"type": "svn", "url": "u"}], [3]])


def test_more_required_names_than_the_other_branch_allows_keys(compiler, tok):
    schema = _repositories({"additionalProperties": {"type": ["boolean", "string"]}, "minProperties": 1,
                            "maxProperties": 1})
    assert pairwise_disjoint(schema["items"]["oneOf"], schema)
    assert not _one_of_left(schema)
    assert_classified(compiler, tok, schema,
                      valid=[[{"type": "git", "url": "u"}, {"packagist.org": False}], [{"type": "git"}],
                             [{"type": "git", "url": "u", "x": 1}]],
                      invalid=[[{}], [{"a": 1}], [{"type": "svn", "url": "u"}], [{"type": 1, "url": "u"}]])


def test_an_additional_value_both_branches_take_is_not_exclusive():
    """{"type": "git", "url": "u"} matches both when additional values may be strings and
    the other branch has no bound on its keys; beside patternProperties a name may take a
    pattern's schema instead of additionalProperties."""
    schema = _repositories({"additionalProperties": {"type": "string"}})
    assert not pairwise_disjoint(schema["items"]["oneOf"], schema)
    _same_language(schema, [[{"type": "git", "url": "u"}], [{"a": "b"}], [{"type": "git"}]])
    patterned = _repositories({"additionalProperties": {"enum": [False]}, "patternProperties": {"^t": {}}})
    assert not pairwise_disjoint(patterned["items"]["oneOf"], patterned)


# MaskBench Github_hard o10421: a definition no value satisfies (an object that is one of two
# strings), reached only through an anyOf branch that instances need not take
NO_VALUE_BRANCH = {"type": "object", "properties": {"content": {"anyOf": [
    {"type": "object", "properties": {"lang": {"type": "string"}}},
    {"type": "object", "properties": {"type": {"$ref": "#/$defs/kind"}}}]}},
    "$defs": {"kind": {"type": "object", "oneOf": [{"enum": ["text", "html"]}, {"type": "string", "pattern": "/"}]}}}


def test_a_subschema_of_no_type_becomes_false(compiler, tok):
    out = rewrite_schema(NO_VALUE_BRANCH)
    assert out["$defs"]["kind"] is False
    assert_classified(compiler, tok, NO_VALUE_BRANCH, valid=[{}, {"content": {"type": "text"}}, {"content": {}}],
                      invalid=[{"content": 1}, []])


# MaskBench Github_hard o43189, Github_easy o69635: an enum of every kind required beside the
# oneOf, one kind listed in each branch (the property's values are those both list)
KIND_BESIDE = {
    "type": "object",
    "required": ["kind"],
    "properties": {"kind": {"type": "string", "enum": ["a", "b", "c"]}, "n": {"type": "integer"}},
    "oneOf": [{"properties": {"kind": {"enum": ["a"]}}},
              {"properties": {"kind": {"enum": ["b"]}, "n": {"minimum": 3}}},
              {"properties": {"kind": {"enum": ["c", "b"]}}}],
}


def test_a_discriminator_narrowed_by_each_branch(compiler, tok):
    two = {**KIND_BESIDE, "oneOf": KIND_BESIDE["oneOf"][:2]}
    assert pairwise_disjoint(two["oneOf"], two, {k: two[k] for k in ("type", "required", "properties")})
    assert not _one_of_left(two)
    assert_classified(compiler, tok, two, valid=[{"kind": "a"}, {"kind": "b", "n": 4}, {"kind": "a", "n": 1}],
                      invalid=[{"kind": "c"}, {"kind": "b", "n": 1}, {}, {"n": 4}])


def test_branches_sharing_a_listed_value_still_overlap():
    """"b" is listed by the second and third branch: {"kind": "b"} (n >= 3) matches both."""
    assert not pairwise_disjoint(KIND_BESIDE["oneOf"], KIND_BESIDE, {k: KIND_BESIDE[k] for k in ("type", "required", "properties")})
    _same_language(KIND_BESIDE, [{"kind": "a"}, {"kind": "b", "n": 4}, {"kind": "b"}, {"kind": "c"}, {"kind": "b", "n": 1}])
