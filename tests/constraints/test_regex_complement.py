"""The complement of a pattern (constraints/regex/complement.py): on random strings, exactly one
of the pattern and its complement matches (search semantics, as JSON Schema's ``pattern``)."""

from __future__ import annotations

import random
import re

import pytest

from constraints.regex.complement import MAX_STATES, complement_pattern
from constraints.regex.dialect import ecma_regex

PATTERNS = ["^[a-z]+$", "customer", "^[ab]", "b$", "^([a-z][0-9])+$", "(\\$)", r"^\d{3}-\d{4}$",
            r"^[.,*\\\s-]+$", "^(?:ab|ba)*$", "[^x]", "a.c", "^(cat|dog)s?$", r"\.json$", '^[^"]*$',
            ",,|^,|,$", "^a|b$"]  # anchors of some top-level alternatives only (JsonSchemaStore madness)
ALPHABET = "abcxyz0129.-$ \n\"é"


@pytest.mark.parametrize("source", PATTERNS)
def test_exactly_one_of_a_pattern_and_its_complement_matches(source):
    pattern = ecma_regex(source, json_string=True)
    other = complement_pattern(pattern)
    assert other is not None
    rng = random.Random(source)
    strings = ["", "customer", "123-4567", "cats", "a.json", "a1b2", "ab", "..."]
    strings += ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(8))) for _ in range(400)]
    for s in strings:
        if "\0" in s:  # the complement keeps out NUL where llguidance's quoting needs it
            continue
        assert _matches(pattern, s) != _matches(other, s), (source, other, s)


def _matches(pattern: str, s: str) -> bool:
    """ECMA-262 search: a final ``$`` is the end of the string (Python's also matches before a
    final newline)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.search(pattern, s) is not None


@pytest.mark.parametrize("source", [
    "(?=a)b",  # lookarounds: not built as a DFA here
    "^(" + "|".join(f"w{i}x{i}y" for i in range(40)) + ")$",  # a complement DFA beyond MAX_STATES
])
def test_patterns_without_a_written_complement(source):
    assert MAX_STATES < 100
    assert complement_pattern(ecma_regex(source)) is None
