"""``oneOf`` over object branches told apart by an optional tag: a property every branch lists
with its own literal values (``"type": {"enum": ["text"]}``), none shared, that the objects
need not have. Every object either has the tag or not:

* with it, an object matches at most the one branch listing its value: each branch with the
  tag required is exclusive as it stands;
* without it, the branches (the tag ruled out: ``"type": false``) are made exclusive on their
  own (:func:`.object_difference.exclusive_objects`), usually with far fewer ways to fail each
  other than the branches with the tag, since no way need name the tag.

The two halves share no object, so ``oneOf`` is the ``anyOf`` of both: exact.
"""

from __future__ import annotations

from typing import Any

from .disjoint import possible_types
from .negation import all_of
from .object_difference import _plain, exclusive_objects
from .tree import resolve
from .validation import same_value_key


def split_on_tag(branches: list[Any], root: dict, context: dict) -> Any:
    """``{"anyOf": [...]}`` accepting exactly the objects (beside ``context``) that match one
    branch alone, split on an optional tag; None when no tag applies or the untagged half has
    no exact form."""
    if len(branches) < 2 or any(possible_types(all_of([context, b]), root) - {"object"} for b in branches):
        return None
    plain = [_plain(b, root) for b in branches]
    if any(p is None for p in plain):
        return None
    tag = _tag(plain, root)
    if tag is None:
        return None
    tagged = [{**p, "required": list(dict.fromkeys([*p.get("required", []), tag]))} for p in plain]
    untagged = [_without(p, tag) for p in plain if tag not in p.get("required", [])]
    if tag in (context.get("required") or []) or not untagged:
        rest: Any = False
    elif len(untagged) == 1:
        rest = untagged[0]
    else:
        rest = exclusive_objects(untagged, root, context)
        if rest is None:
            return None
    options = [*tagged, *(rest["anyOf"] if isinstance(rest, dict) and list(rest) == ["anyOf"] else
                          [] if rest is False else [rest])]
    return {"anyOf": options}


def _tag(plain: list[dict], root: dict) -> str | None:
    """A property every branch lists with literal values (``const`` / ``enum``), no value listed
    by two branches, and not required by every branch (then the branches are disjoint as
    they stand)."""
    first = plain[0].get("properties", {})
    for name in first:
        values = [_literals(p.get("properties", {}).get(name), root) for p in plain]
        if any(v is None for v in values):
            continue
        seen: set[str] = set()
        if any(seen & v or seen.update(v) for v in values):
            continue
        if all(name in p.get("required", []) for p in plain):
            continue
        return name
    return None


def _literals(schema: Any, root: dict) -> set[str] | None:
    """The values a property schema lists (canonical JSON), when it lists some."""
    node = resolve(schema, root)
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {same_value_key(node["const"])}
    if isinstance(node.get("enum"), list):
        return {same_value_key(v) for v in node["enum"]}
    return None


def _without(plain: dict, tag: str) -> dict:
    """``plain`` with the tag ruled out."""
    return {**plain, "properties": {**plain.get("properties", {}), tag: False}}
