"""``patternProperties`` whose regexes overlap, rewritten over disjoint regexes.

A key matching several patterns must meet all their subschemas; llguidance refuses overlapping
patterns instead. The patterns that overlap another are replaced by their regions
(:mod:`constraints.regex.regions`): each region's pattern takes the ``allOf`` of the
subschemas of the patterns its keys match. A key matches the same patterns as before, so it
meets the same subschemas: the rewrite is exact. Patterns that overlap no other stay as written;
where the regions cannot be written the node is left as it is (and llguidance refuses it).
"""

from __future__ import annotations

import copy
from typing import Any

from ..regex.disjoint import patterns_disjoint
from ..regex.regions import pattern_regions
from .negation import all_of

MAX_OVERLAPPING = 16  # patterns cut into regions together, at most


def disjoint_pattern_properties(node: dict) -> dict:
    """``node`` with its ``patternProperties`` made pairwise disjoint where they overlap (the
    same keys take the same subschemas), or ``node`` itself when they are disjoint already or
    the regions cannot be written."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or len(patterns) < 2 or not all(isinstance(p, str) for p in patterns):
        return node
    keys = list(patterns)
    overlapping = [k for k in keys if any(o != k and not patterns_disjoint(k, o) for o in keys)]
    if not overlapping or len(overlapping) > MAX_OVERLAPPING:
        return node
    regions = pattern_regions(overlapping)
    if regions is None:
        return node
    out: dict[str, Any] = {k: v for k, v in patterns.items() if k not in overlapping}
    for pattern, members in regions:  # a subschema taken by several regions is copied
        out[pattern] = all_of([copy.deepcopy(patterns[overlapping[i]]) for i in members])
    if len(out) != len(patterns) - len(overlapping) + len(regions):
        return node  # two patterns written alike (never for disjoint non-empty languages)
    return {**node, "patternProperties": out}
