"""Overlapping patterns cut into disjoint regions (constraints/regex/regions.py), and
``patternProperties`` rewritten over them (constraints/schema/pattern_regions.py)."""

from __future__ import annotations

import random
import re

import jsonschema
import pytest

from constraints.regex.dialect import ecma_regex
from constraints.regex.disjoint import patterns_disjoint
from constraints.regex.regions import pattern_regions
from constraints.schema.pattern_regions import disjoint_pattern_properties

ALPHABET = "abcdeghipt_MD5-0"
GROUPS = [
    ["hipchat", "github"],
    [".*", "^_execute_browser_action$", "^_execute_page_action$"],
    ["^[a-zA-Z0-9_-]{1,}$", "^MD5$", "^MD6$"],  # MaskBench Github_medium o51177
    ["^a", "b$", "^ab$"],
]


def _matches(pattern: str, s: str) -> bool:
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.search(pattern, s) is not None


def _strings(seed: str, extra: list[str]) -> list[str]:
    rng = random.Random(seed)
    return extra + ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(10))) for _ in range(400)]


@pytest.mark.parametrize("sources", GROUPS)
def test_every_string_lies_in_the_region_of_exactly_the_patterns_it_matches(sources):
    patterns = [ecma_regex(s, json_string=True) for s in sources]
    regions = pattern_regions(patterns)
    assert regions is not None
    for s in _strings(str(sources), ["", "hipchat-github", "_execute_page_action", "MD5", "ab", "a", "b"]):
        matched = tuple(i for i, p in enumerate(patterns) if _matches(p, s))
        holding = [members for region, members in regions if _matches(region, s)]
        assert holding == ([matched] if matched else []), (s, holding, matched)


def test_overlapping_pattern_properties_become_disjoint_with_the_same_meaning():
    node = {"type": "object", "patternProperties": {
        ecma_regex("^[a-z]+$", json_string=True): {"type": "string"},
        ecma_regex("^id$", json_string=True): {"minLength": 2},
        ecma_regex("^[0-9]+$", json_string=True): {"type": "integer"}}}
    out = disjoint_pattern_properties(node)
    patterns = list(out["patternProperties"])
    assert all(patterns_disjoint(a, b) for i, a in enumerate(patterns) for b in patterns[i + 1:])
    assert ecma_regex("^[0-9]+$", json_string=True) in patterns  # overlapping nothing: as written
    for instance in [{"id": "x"}, {"id": "xy"}, {"id": 1}, {"ab": 1}, {"ab": "c"}, {"12": 3}, {"12": "3"}, {"I": 0}]:
        assert _valid(out, instance) == _valid(node, instance), instance


def test_disjoint_or_unwritable_patterns_are_left_as_written():
    disjoint = {"patternProperties": {"^a$": {}, "^b$": {"type": "string"}}}
    assert disjoint_pattern_properties(disjoint) is disjoint
    unwritten = {"patternProperties": {"(?=a)": {}, "a": {"type": "string"}}}
    assert disjoint_pattern_properties(unwritten) is unwritten


def _valid(schema: dict, instance: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_intersections_keep_a_pattern_the_other_contains():
    from constraints.regex.regions import intersect_patterns

    wide, narrow = ecma_regex(".+", json_string=True), ecma_regex("^[a-z]{8,16}-[0-9]+$", json_string=True)
    assert intersect_patterns(narrow, wide) is True
    assert intersect_patterns(wide, narrow) == narrow
    assert intersect_patterns(ecma_regex("^[0-9]"), narrow) is False
