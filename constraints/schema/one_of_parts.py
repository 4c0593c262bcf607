"""``oneOf`` made exclusive part by part, where the whole resists the rewrites of
:mod:`.negation` and :mod:`.object_difference`:

* **Overlap groups.** Branches that share no instance with any branch of another group (beside
  the keywords around the ``oneOf``: :mod:`.disjoint`) can only be told apart within their own
  group: an instance matching a branch of one group matches no branch of the others. So
  "exactly one branch" is the ``anyOf`` over the groups of "exactly one branch of this group";
  a group of one branch is that branch, a larger group needs an exact form of its own
  (``exclusive_host_formats``, ``exactly_one`` or ``exclusive_objects``), else the whole stays
  refused.
* **Untyped object branches.** Two branches that say only object keywords, with no ``type``,
  both accept every non-object, so a ``oneOf`` holding them rejects every non-object: it is
  ``type: object`` beside the ``oneOf``, and the branches need be exclusive among objects only.
* **Optional tags.** Object branches told apart by a tag the objects need not have are split
  on its presence (:mod:`.tag_split`).

Both steps are exact; neither ever widens what the ``oneOf`` accepts.
"""

from __future__ import annotations

from typing import Any, Callable

from .address_formats import exclusive_host_formats
from .disjoint import OBJECT_KEYWORDS, _disjoint, possible_types
from .keywords import SPEC_KEYWORDS, meaningful
from .negation import all_of, exactly_one
from .object_difference import exclusive_objects
from .tag_split import split_on_tag
from .tree import resolve

Exclusive = Callable[[list[Any], dict, dict], Any]


def exclusive_parts(branches: list[Any], root: dict, context: dict) -> Any:
    """A schema accepting exactly the instances (beside ``context``) that match one of
    ``branches`` alone, or None when no step here gives an exact form."""
    if _untyped_objects(branches, root) >= 2 and "object" in possible_types(context or {}, root):
        inner = {**context, "type": "object"}
        form = _by_groups(branches, root, inner, whole_tried=False)
        return None if form is None else all_of([{"type": "object"}, form])
    return _by_groups(branches, root, context, whole_tried=True)


def _untyped_objects(branches: list[Any], root: dict) -> int:
    """How many branches say object keywords alone (no ``type``): each accepts every non-object."""
    count = 0
    for branch in branches:
        node = resolve(branch, root)
        if isinstance(node, dict) and {k for k in meaningful(node) if k in SPEC_KEYWORDS} <= OBJECT_KEYWORDS:
            count += 1
    return count


def overlap_groups(branches: list[Any], root: dict, context: dict) -> list[list[int]]:
    """The branch indices grouped so that no branch shares an instance (beside ``context``)
    with a branch of another group, as far as :mod:`.disjoint` proves: the connected parts of
    the "not proven disjoint" relation, in the branches' order."""
    wrapped = [all_of([context, b]) if context else b for b in branches]
    parent = list(range(len(branches)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(branches)):
        for j in range(i + 1, len(branches)):
            if find(i) != find(j) and not _disjoint(wrapped[i], wrapped[j], root):
                parent[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in range(len(branches)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _by_groups(branches: list[Any], root: dict, context: dict, whole_tried: bool) -> Any:
    groups = overlap_groups(branches, root, context)
    # the caller's own rewrites failed on a group of all the branches: only the split is new
    tried = whole_tried and len(groups) == 1
    options: list[Any] = []
    for group in groups:
        members = [branches[i] for i in group]
        form = members[0] if len(members) == 1 else _group_form(members, root, context, tried)
        if form is None:
            return None
        if form is not False:
            options.append(form)
    if not options:
        return False
    return options[0] if len(options) == 1 else {"anyOf": options}


def _group_form(members: list[Any], root: dict, context: dict, tried: bool) -> Any:
    """"Exactly one of ``members``" (beside ``context``), or None. ``tried``: the negations
    and object differences are known to fail on them."""
    form = exclusive_host_formats(members, root)
    if form is None and not tried:
        form = exactly_one(members, root)
    if form is None and not tried:
        form = exclusive_objects(members, root, context)
    if form is None:
        form = split_on_tag(members, root, context)
    return form
