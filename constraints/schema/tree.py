"""A JSON schema as a tree, as every schema module reads it: the keywords that hold
subschemas and a walk over them, JSON pointers into a schema, a local ``$ref`` followed to its
target, the draft its ``$schema`` names, and two schemas conjoined."""

from __future__ import annotations

from typing import Any, Iterator
from urllib.parse import unquote

SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LIST_KEYS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_KEYS = ("not", "if", "then", "else", "additionalProperties", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def escape_part(part: str) -> str:
    """``part`` escaped as one reference token of a JSON pointer."""
    return part.replace("~", "~0").replace("/", "~1")


def subschemas(node: Any, pointer: str = "") -> Iterator[tuple[str, Any]]:
    """(pointer, subschema) for ``node`` and every schema nested in it, depth first."""
    yield pointer, node
    for child_pointer, child in children(node, pointer):
        yield from subschemas(child, child_pointer)


def children(node: Any, pointer: str = "") -> Iterator[tuple[str, Any]]:
    """(pointer, subschema) for each schema directly inside ``node`` (one keyword down)."""
    if not isinstance(node, dict):
        return
    for key in SCHEMA_MAP_KEYS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield f"{pointer}/{key}/{escape_part(name)}", sub
    for key in SCHEMA_LIST_KEYS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"{pointer}/{key}/{i}", sub
    for key in SCHEMA_KEYS:
        if isinstance(node.get(key), (dict, bool)):
            yield f"{pointer}/{key}", node[key]
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield f"{pointer}/items/{i}", sub
    elif isinstance(items, (dict, bool)):
        yield f"{pointer}/items", items
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                yield f"{pointer}/dependencies/{escape_part(name)}", sub


def pointer_parts(pointer: str) -> list[str]:
    """The reference tokens of JSON pointer ``pointer`` (``/a/b``, URI-escaped or not)."""
    return [unquote(part).replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]


def at_pointer(document: Any, pointer: str) -> Any:
    """The value at JSON pointer ``pointer`` (``/a/b``, URI-escaped or not; ``""``: the whole
    document), or None."""
    for part in pointer_parts(pointer) if pointer else []:
        if isinstance(document, dict) and part in document:
            document = document[part]
        elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
            document = document[int(part)]
        else:
            return None
    return document


def resolve(node: Any, root: dict, depth: int = 0) -> Any:
    """``node`` with bare local ``$ref`` s followed to their targets in ``root`` (as far as
    they resolve, at most 32 deep)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and len(node) == 1 and depth < 32:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, depth = target, depth + 1
    return node


def names_draft(root: Any, drafts: tuple[str, ...]) -> bool:
    """Whether the root's ``$schema`` names one of ``drafts`` (``"draft-04"``, ``"2019-09"``, ...)."""
    uri = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(uri, str) and any(d in uri for d in drafts)


def conjoin(node: dict, extra: Any, replacing: tuple[str, ...] = ()) -> Any:
    """``node`` and ``extra`` (node | False), ``extra`` added to the node's ``allOf``.

    The keywords in ``replacing`` are removed and the ``allOf`` takes the place of the first of
    them: llguidance (like every engine) writes an object's properties in the order its schema
    declares them, and it reads that order from where each keyword sits in the schema
    (``{"oneOf": [...], "properties": ...}`` puts the branches' properties first), so a
    rewrite must not move the properties of a keyword it replaces behind the others.
    """
    if extra is False:
        return False
    first = next((k for k in node if k in replacing), None)
    trivial = extra is True or extra == {}
    if first is None:
        if not trivial:
            node["allOf"] = [*node.get("allOf", []), extra]
        return node
    out: dict = {}
    for key, value in node.items():
        if key == first and not trivial:
            before = list(out.get("allOf", []))  # an allOf that came earlier keeps its place
            after = list(node.get("allOf", [])) if "allOf" not in out else []
            out["allOf"] = [*before, extra, *after]
        elif key in replacing or (key == "allOf" and "allOf" in out):
            continue
        else:
            out[key] = value
    return out
