"""Objects whose properties may be written in any order (small objects, within a budget).

llguidance and xgrammar both make an object's properties follow the order ``properties``
lists them in; JSON Schema gives object members no order, so ``{"b": 1, "a": 2}`` is as valid
as ``{"a": 2, "b": 1}``. For an object node with a few listed properties, :func:`any_order`
replaces the node by ``anyOf`` over copies of it that list the properties in every order. Every
copy is the same JSON Schema (member order means nothing to a validator), so the rewrite
accepts exactly the same instances and only more spellings of them; within each spelling the
backends still enforce each property once, ``required`` and every property's schema.

The property values are moved to ``$defs`` and referenced from each copy, so a value's grammar
is built once, not once per order. Orders grow as n!, so only objects of at most
:data:`MAX_PROPERTIES` properties are rewritten, outermost first, until :data:`MAX_BRANCHES`
copies were made in the whole schema; the rest keep the declared order (fewer spellings, never
a wrong instance) unless :mod:`.runtime_checks` freed it (larger objects, checked as written). Members an object does not list (``additionalProperties`` /
``patternProperties``) still come after the listed ones, as the backends write them.
"""

from __future__ import annotations

import itertools
import json
from typing import Any
from urllib.parse import unquote

from .keywords import SPEC_KEYWORDS
from .runtime_checks import FREED_MARK
from .tree import SCHEMA_KEYS, SCHEMA_LIST_KEYS, SCHEMA_MAP_KEYS, at_pointer, escape_part, subschemas

MAX_PROPERTIES = 4  # 4! = 24 orders
MAX_BRANCHES = 96  # copies made in one schema
DEFS_PREFIX = "trellis-order-"

# keywords a rewritten node may hold besides ``properties``: every copy repeats them, so none
# may be an applicator (copies would multiply its grammar) or a location that pointers,
# anchors or base URIs refer to
_COPYABLE = frozenset(
    {"type", "required", "additionalProperties", "patternProperties", "minProperties",
     "maxProperties", "title", "description", "default", "examples", "$comment", "deprecated",
     "readOnly", "writeOnly"}
)
_DYNAMIC_KEYS = ("$dynamicAnchor", "$recursiveAnchor", "$dynamicRef", "$recursiveRef")


def any_order(schema: Any) -> Any:
    """``schema`` (already rewritten) with its small objects accepting any property order; the
    input is not modified. Left as it is when a subschema below the root sets a new base URI
    (``$id``/``id`` other than a bare fragment) or uses dynamic references: moving a value
    under ``$defs`` could change what its references resolve to. Fragment ids and anchors
    stay valid (they name a subschema wherever it sits in the document)."""
    if not isinstance(schema, dict) or _has_locations(schema) or any(
        str(k).startswith(DEFS_PREFIX) for k in schema.get("$defs") or ()
    ):
        return schema
    refs = {n["$ref"] for _, n in subschemas(schema) if isinstance(n, dict) and isinstance(n.get("$ref"), str)}
    targets = [unquote(r[1:]) for r in refs if r.startswith("#/")]  # URI fragments may be %-escaped
    root = json.loads(json.dumps(schema))
    state = _State(root, targets, _kept_branches(schema))
    out = state.visit(root, "")
    if not state.defs:
        return schema
    return {**out, "$defs": {**(out.get("$defs") or {}), **state.defs}}


def _has_locations(schema: dict) -> bool:
    for pointer, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        if any(key in node for key in _DYNAMIC_KEYS):
            return True
        for key in ("$id", "id"):
            value = node.get(key)
            if pointer and isinstance(value, str) and not value.startswith("#"):
                return True
    return False


def _kept_branches(schema: dict) -> set[str]:
    """Pointers of the ``oneOf`` branches and ``allOf`` members left in the schema and of what
    their ``$ref`` chains lead to: llguidance proves ``oneOf`` branches exclusive from their own
    ``properties`` (an ``anyOf`` of copies would hide them) and intersects ``allOf`` members
    (copies would multiply), so they keep their form."""
    out: set[str] = set()
    for pointer, node in subschemas(schema):
        for key in ("oneOf", "allOf"):
            if isinstance(node, dict) and isinstance(node.get(key), list):
                for i, branch in enumerate(node[key]):
                    _add_chain(schema, f"{pointer}/{key}/{i}", branch, out)
    return out


def _add_chain(schema: dict, pointer: str, branch: Any, out: set[str]) -> None:
    """``pointer`` and every target of the ``$ref`` chain that starts at ``branch``."""
    out.add(pointer)
    for _ in range(16):
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/")):
            return
        out.add(ref[1:])
        branch = at_pointer(schema, ref[1:])


class _State:
    def __init__(self, root: dict, ref_targets: list[str], kept_branches: set[str]) -> None:
        self.root = root
        self.ref_targets = ref_targets
        self.kept_branches = kept_branches
        self.defs: dict[str, Any] = {}
        self.branches = 0

    def visit(self, node: Any, pointer: str) -> Any:
        """``node`` with its eligible objects rewritten, in pre-order (an object before the
        objects inside it: the budget goes to the outer ones first)."""
        if not isinstance(node, dict):
            return node
        self._keep_intersected(node, pointer)
        if self._eligible(node, pointer):
            return self._rewrite(node, pointer)
        self._children(node, pointer)
        return node

    def _keep_intersected(self, node: dict, pointer: str) -> None:
        """Beside ``patternProperties``, a member's value may be intersected with a pattern's
        (a name matching both): llguidance builds that product, and copies on both sides would
        multiply it (MaskBench WashingtonPost wp_68: 24 x 24 branches ran into its limits), so
        those values keep their form."""
        patterns = node.get("patternProperties")
        if not isinstance(patterns, dict) or not patterns:
            return
        exact = set(node.get(FREED_MARK) or ())  # exact names no other pattern matches
        for key in ("properties", "patternProperties"):
            for name in node.get(key) or {}:
                if name not in exact:
                    self.kept_branches.add(f"{pointer}/{key}/{escape_part(name)}")

    def _children(self, node: dict, pointer: str) -> None:
        for key in SCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {k: self.visit(v, f"{pointer}/{key}/{escape_part(k)}") for k, v in node[key].items()}
        for key in SCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [self.visit(v, f"{pointer}/{key}/{i}") for i, v in enumerate(node[key])]
        for key in (*SCHEMA_KEYS, "items"):
            if isinstance(node.get(key), dict):
                node[key] = self.visit(node[key], f"{pointer}/{key}")
        if isinstance(node.get("items"), list):
            node["items"] = [self.visit(v, f"{pointer}/items/{i}") for i, v in enumerate(node["items"])]

    def _eligible(self, node: dict, pointer: str) -> bool:
        props = node.get("properties")
        if not isinstance(props, dict) or not 2 <= len(props) <= MAX_PROPERTIES:
            return False
        if pointer in self.kept_branches:
            return False
        if self.branches + _factorial(len(props)) > MAX_BRANCHES:
            return False
        if set(node) - _COPYABLE - {"properties", "$defs", "definitions", "$schema"} - _unknown_keys(node):
            return False
        if not isinstance(node.get("patternProperties", {}), dict):
            return False
        moved = [f"{pointer}/{escape_part(k)}" for k in ("properties", *_unknown_keys(node))]
        return not any(t == inside or t.startswith(inside + "/") for t in self.ref_targets for inside in moved)

    def _rewrite(self, node: dict, pointer: str) -> dict:
        """``anyOf`` over the node's copies, one per order of its properties (values in $defs)."""
        props: dict[str, Any] = node["properties"]
        self.branches += _factorial(len(props))
        refs = {name: self._hoist(value, f"{pointer}/properties/{escape_part(name)}") for name, value in props.items()}
        kept = {k: v for k, v in node.items() if k in ("$defs", "definitions", "$schema")}
        self._children(kept, pointer)
        dropped = _unknown_keys(node)  # no draft's keywords: they assert nothing, and no $ref leads into them
        rest = {k: v for k, v in node.items() if k not in kept and k != "properties" and k not in dropped}
        # the other member schemas are repeated in every copy: each copy refers to one of them
        if isinstance(rest.get("additionalProperties"), dict):
            rest["additionalProperties"] = self._hoist(rest["additionalProperties"], f"{pointer}/additionalProperties")
        if rest.get("patternProperties"):
            rest["patternProperties"] = {
                regex: self._hoist(value, f"{pointer}/patternProperties/{escape_part(regex)}")
                for regex, value in rest["patternProperties"].items()
            }
        copies = [{**rest, "properties": {name: refs[name] for name in order}}
                  for order in itertools.permutations(refs)]
        return {**kept, "anyOf": copies}


    def _hoist(self, value: Any, pointer: str) -> Any:
        """``{"$ref": …}`` to ``value`` (its own objects rewritten) placed under ``$defs``; a
        boolean schema stays in place (llguidance reads a forbidden property only as ``false``
        written there, not behind a ``$ref``)."""
        if isinstance(value, bool):
            return value
        key = f"{DEFS_PREFIX}{len(self.defs)}"
        self.defs[key] = True  # reserved before the value's own objects take names
        self.defs[key] = self.visit(value, pointer)
        return {"$ref": f"#/$defs/{key}"}


def _unknown_keys(node: dict) -> set[str]:
    """The keys of ``node`` that no draft defines (``x-taplo``, ``self``, ``Comment``): they
    assert nothing, so the copies leave them out."""
    return {k for k in node if k not in SPEC_KEYWORDS and not k.startswith(("x-guidance", "x-trellis"))}


def _factorial(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out
