"""References inside one schema document, resolved and written as JSON pointers from the root.

A ``$ref`` may name its target by a URI made of the base URIs that ``$id`` (``id`` in drafts 3
and 4) sets anywhere in the document: a subschema's ``$id``, a JSON pointer inside it, or a
plain-name fragment (``$anchor``, ``$dynamicAnchor``, or ``$id: "#name"`` in drafts 4 to 7).
Each base is its ``$id`` resolved (RFC 3986) against the base of the enclosing schema, so an
``$id`` under ``if``, ``not`` or ``$defs`` is as reachable as one at the root. Every reference is
rewritten to ``#/json/pointer`` from the root and the identifiers are dropped, so each backend
and each rewrite of :mod:`.analysis` reads the same target (no backend re-resolves a relative
URI against a base it does not know about).

``$dynamicRef`` (2020-12) and ``$recursiveRef`` (2019-09) depend on the dynamic scope: the
schema resources entered on the way to them. All the ways to reach each one from the root are
walked with the resources they enter; when every way leads to one target, it becomes a plain
reference to it. When the target depends on the path, the subschemas that lead to the reference
are copied once per dynamic scope (a few dozen at most, else it is refused by name) and each
copy refers to its own target.

A reference to a URI no subschema declares is remote and is never fetched: an
UnsupportedConstraintError; a fragment that resolves to nothing is an InvalidConstraintError.
"""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import quote, urljoin

from ..errors import InvalidConstraintError, UnsupportedConstraintError
from .tree import at_pointer, children, escape_part, names_draft, pointer_parts, subschemas

MAX_SCOPES = 20_000  # (subschema, dynamic scope) pairs the dynamic-reference walk may visit
MAX_COPIES = 64  # subschemas copied so that each dynamic reference has one target per copy
DYNAMIC_PREFIX = "trellis-dynamic-"
_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_RECURSIVE = "\x00recursive"  # the one "name" $recursiveAnchor declares
_AMBIGUOUS = None  # an identifier declared twice: references to it are left as written
_POINTER_SAFE = "/~!$&'()*+,;=:@"


def resolve_references(schema: Any) -> Any:
    """``schema`` (changed in place) with every ``$ref``, ``$dynamicRef`` and ``$recursiveRef``
    rewritten as ``#/pointer`` from the root, and ``$id`` / ``$anchor`` / ``$dynamicAnchor``
    dropped once nothing needs them. A name declared twice in one resource leaves its
    references as written (and every identifier in place)."""
    if isinstance(schema, dict):
        _References(schema).rewrite()
    return schema


def inline_boolean_refs(schema: Any) -> None:
    """Each bare ``{"$ref": "#/…"}`` to a ``true`` / ``false`` schema becomes that schema, in
    place (llguidance cannot resolve a reference to a boolean schema)."""
    found = [(p, n) for p, n in subschemas(schema) if p and isinstance(n, dict) and set(n) == {"$ref"}
             and isinstance(n["$ref"], str) and n["$ref"].startswith("#")]
    for pointer, node in found:
        target = at_pointer(schema, node["$ref"][1:])
        if not isinstance(target, bool):
            continue
        parent_pointer, _, key = pointer.rpartition("/")
        parent = at_pointer(schema, parent_pointer)
        key = key.replace("~1", "/").replace("~0", "~")
        if isinstance(parent, dict) and parent.get(key) is node:
            parent[key] = target
        elif isinstance(parent, list) and key.isdigit() and parent[int(key)] is node:
            parent[int(key)] = target


def check_references(schema: Any) -> None:
    """Raise as :func:`resolve_references` would, changing nothing."""
    if isinstance(schema, dict):
        _References(schema).check()


def join(base: str, ref: str) -> str:
    """``ref`` resolved against ``base`` (RFC 3986; a fragment alone also against a URN)."""
    if _SCHEME.match(ref):
        return ref
    if ref.startswith("#") or not ref:
        return base.partition("#")[0] + ref
    return urljoin(base, ref)


def _pointer(parts: list[str]) -> str:
    return "".join("/" + escape_part(p) for p in parts)


def _fragment(pointer: str) -> str:
    """A JSON pointer as a URI fragment (``#/a%20b``)."""
    return "#" + quote(pointer, safe=_POINTER_SAFE)


class _References:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.legacy_ids = names_draft(root, ("draft-03", "draft-04")) or "$schema" not in root
        self.ref_hides_id = names_draft(root, ("draft-03", "draft-04", "draft-06", "draft-07"))
        self.resources: dict[str, str | None] = {}  # base URI -> pointer of its root
        self.anchors: dict[tuple[str, str], str | None] = {}  # (base URI, name) -> pointer
        self.dynamic: dict[tuple[str, str], str] = {}  # (base URI, name) -> pointer, dynamic anchors
        self.bases: dict[str, str] = {}  # pointer -> base URI there
        self.ambiguous = False
        self._index()

    # -- the identifiers ---------------------------------------------------------------------

    def _identifier(self, node: dict) -> str | None:
        if self.ref_hides_id and "$ref" in node:
            return None  # drafts 3 to 7 ignore every keyword beside $ref
        if isinstance(node.get("$id"), str):
            return node["$id"]
        if self.legacy_ids and isinstance(node.get("id"), str):
            return node["id"]
        return None

    def _index(self) -> None:
        stack: list[tuple[str, Any, str]] = [("", self.root, "")]
        while stack:
            pointer, node, base = stack.pop()
            if isinstance(node, dict):
                base = self._declare(pointer, node, base)
            elif pointer == "":
                self._name(self.resources, base, pointer)
            self.bases[pointer] = base
            stack.extend((p, child, base) for p, child in children(node, pointer))

    def _declare(self, pointer: str, node: dict, base: str) -> str:
        """Record what ``node`` declares; the base URI inside it."""
        ident = self._identifier(node)
        if ident is not None and not ident.startswith("#"):
            base = join(base, ident).partition("#")[0]
        if pointer == "" or ident is not None and not ident.startswith("#"):
            self._name(self.resources, base, pointer)
        names = []
        if ident is not None and "#" in ident and ident.partition("#")[2]:
            names.append(ident.partition("#")[2])  # drafts 4 to 7: "$id": "#name"
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                names.append(node[key])
        for name in dict.fromkeys(names):
            self._name(self.anchors, (base, name), pointer)
        if isinstance(node.get("$dynamicAnchor"), str):
            self.dynamic[(base, node["$dynamicAnchor"])] = pointer
        if node.get("$recursiveAnchor") is True:
            self.dynamic[(base, _RECURSIVE)] = pointer
        return base

    @staticmethod
    def _name(table: dict, key: Any, pointer: str) -> None:
        table[key] = _AMBIGUOUS if key in table and table[key] != pointer else pointer

    # -- resolution ----------------------------------------------------------------------------

    def target(self, base: str, ref: str, keyword: str, where: str) -> str | None:
        """The pointer ``ref`` names from ``base`` (None: a name declared twice)."""
        document, _, fragment = join(base, ref).partition("#")
        if document not in self.resources:
            raise UnsupportedConstraintError(
                f"{keyword} {ref!r} at {where} is not a reference into this schema "
                "(remote and relative references are not fetched)", pointer=where, keyword=keyword)
        start = self.resources[document]
        if start is _AMBIGUOUS:
            return None
        if fragment and not fragment.startswith("/"):
            found = self.anchors.get((document, fragment), "missing")
            if found == "missing" and ref.startswith("#"):
                found = self._anywhere(fragment)
            if found == "missing":
                raise InvalidConstraintError(f"{keyword} {ref!r} at {where} does not resolve to a subschema",
                                             pointer=where, keyword=keyword)
            return found
        pointer = start + _pointer(pointer_parts(fragment)) if fragment else start
        if not isinstance(at_pointer(self.root, pointer), (dict, bool)) and ref.startswith("#/") \
                and isinstance(at_pointer(self.root, fragment), (dict, bool)):
            # a legacy "id" that is no base URI ("id": "/properties/a", as schema generators
            # write): its pointers were meant from the document's root
            pointer = _pointer(pointer_parts(fragment))
        if not isinstance(at_pointer(self.root, pointer), (dict, bool)):
            raise InvalidConstraintError(f"{keyword} {ref!r} at {where} does not resolve to a subschema",
                                         pointer=where, keyword=keyword)
        return pointer

    def _anywhere(self, name: str) -> str | None:
        """The one subschema any resource names ``name`` ("missing" when none does): a bare
        ``#name`` under a legacy ``id`` that is no base URI meant the document's name."""
        found = {pointer for (_, n), pointer in self.anchors.items() if n == name}
        return "missing" if not found else found.pop() if len(found) == 1 else _AMBIGUOUS

    def base_at(self, pointer: str) -> str:
        """The base URI at ``pointer`` (inside an unknown keyword: its nearest schema's)."""
        while pointer not in self.bases:
            pointer = pointer.rpartition("/")[0]
        return self.bases[pointer]

    def _references(self) -> list[tuple[str, dict, str, str]]:
        """(pointer, node, keyword, value) for every reference in the document."""
        out = []
        for pointer, node in subschemas(self.root):
            if isinstance(node, dict):
                for keyword in ("$ref", "$dynamicRef", "$recursiveRef"):
                    if keyword in node:
                        if not isinstance(node[keyword], str):
                            where = f"{pointer}/{keyword}"
                            raise InvalidConstraintError(f"{keyword} at {where} must be a string",
                                                         pointer=where, keyword=keyword)
                        out.append((pointer, node, keyword, node[keyword]))
        return out

    def check(self) -> None:
        for pointer, _, keyword, ref in self._references():
            self._static(pointer, keyword, ref)

    def _static(self, pointer: str, keyword: str, ref: str) -> str | None:
        base = self.base_at(pointer)
        if keyword == "$recursiveRef":
            ref = "#"
        return self.target(base, ref, keyword, f"{pointer}/{keyword}")

    def rewrite(self) -> None:
        refs = self._references()
        statics = {(p, k): self._static(p, k, r) for p, _, k, r in refs}
        dynamic = {(p, k): n for p, _, k, r in refs if k != "$ref"
                   if (n := self._dynamic_name(k, r, statics[(p, k)])) is not None}
        found = self._dynamic_targets(dynamic, statics) if dynamic else {}
        if any(len(targets) > 1 for targets in found.values()):
            _Specialiser(self, statics, dynamic, found).run()
        else:
            chosen = {key: next(iter(targets)) for key, targets in found.items() if targets}
            for pointer, node, keyword, _ in refs:
                target = chosen.get((pointer, keyword), statics[(pointer, keyword)])
                if target is None:
                    self.ambiguous = True
                else:
                    _write(node, keyword, _fragment(target))
        if not self.ambiguous:
            self._drop_identifiers()
        inline_boolean_refs(self.root)

    # -- dynamic references ----------------------------------------------------------------------

    def _dynamic_name(self, keyword: str, ref: str, static: str | None) -> str | None:
        """The anchor name a dynamic reference searches the scope for (None: it is static)."""
        if static is None:
            return None
        node = at_pointer(self.root, static)
        if keyword == "$recursiveRef":
            return _RECURSIVE if isinstance(node, dict) and node.get("$recursiveAnchor") is True else None
        name = ref.partition("#")[2]
        if not name or name.startswith("/") or not isinstance(node, dict) or node.get("$dynamicAnchor") != name:
            return None
        return name

    def _dynamic_targets(self, names: dict[tuple[str, str], str],
                         statics: dict[tuple[str, str], str | None]) -> dict[tuple[str, str], set[str]]:
        """The targets of each dynamic reference over every path from the root (through
        applicators and references: definitions are reached only by reference)."""
        found: dict[tuple[str, str], set[str]] = {key: set() for key in names}
        seen: set[tuple[str, tuple[str, ...]]] = set()
        stack: list[tuple[str, tuple[str, ...]]] = [("", ())]
        while stack:
            pointer, scope = stack.pop()
            base = self.base_at(pointer)
            if base not in scope:
                scope = (*scope, base)
            if (pointer, scope) in seen:
                continue
            seen.add((pointer, scope))
            if len(seen) > MAX_SCOPES:
                key = next(iter(names))
                raise self._refuse(key, f"reaching it takes more than {MAX_SCOPES} distinct paths")
            node = at_pointer(self.root, pointer)
            if not isinstance(node, dict):
                continue
            for keyword in ("$ref", "$dynamicRef", "$recursiveRef"):
                key = (pointer, keyword)
                if key in names:
                    target = self.resolve_dynamic(key, names[key], scope, statics[key])
                    found[key].add(target)
                    stack.append((target, scope))
                elif statics.get(key) is not None:
                    stack.append((statics[key], scope))
            stack.extend((p, scope) for p, _ in children(node, pointer) if not _into_definitions(p, pointer))
        return found

    def resolve_dynamic(self, key: tuple[str, str], name: str, scope: tuple[str, ...], static: str) -> str:
        """The target of dynamic reference ``key`` seeking anchor ``name`` in ``scope``: the
        outermost resource there that declares it dynamically, else ``static``."""
        return next((self.dynamic[(uri, name)] for uri in scope if (uri, name) in self.dynamic), static)

    def _refuse(self, key: tuple[str, str], why: str) -> UnsupportedConstraintError:
        pointer, keyword = key
        where = f"{pointer}/{keyword}"
        return UnsupportedConstraintError(f"keyword {keyword!r} at {where} is not supported for enforcement: {why}",
                                          pointer=where, keyword=keyword)

    def _drop_identifiers(self) -> None:
        for _, node in subschemas(self.root):
            if not isinstance(node, dict):
                continue
            for key in ("$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor"):
                if isinstance(node.get(key), (str, bool)):
                    del node[key]
            if self.legacy_ids and isinstance(node.get("id"), str):
                del node["id"]


def _write(node: dict, keyword: str, ref: str) -> None:
    """``node``'s reference ``keyword`` replaced by ``"$ref": ref`` (in an ``allOf`` when the
    node holds another reference)."""
    if keyword == "$ref":
        node["$ref"] = ref
        return
    del node[keyword]
    if "$ref" in node or any(k in node for k in ("$dynamicRef", "$recursiveRef")):
        node.setdefault("allOf", []).append({"$ref": ref})
    else:
        node["$ref"] = ref


class _Specialiser:
    """The document rewritten so that every dynamic reference has one target: a subschema
    from which a path-dependent dynamic reference can be reached is copied once per dynamic
    scope it is reached with (at most :data:`MAX_COPIES`), under ``$defs``, and references
    lead to the copy of their scope."""

    def __init__(self, refs: _References, statics: dict, names: dict, found: dict) -> None:
        self.refs = refs
        self.original = copy.deepcopy(refs.root)
        self.statics, self.names = statics, names
        self.single = {key: next(iter(t)) for key, t in found.items() if len(t) == 1}
        self.multi = {key for key, t in found.items() if len(t) > 1}
        self.affected = self._affected(found)
        self.copies: dict[tuple[str, tuple[str, ...]], str] = {}
        self.queue: list[tuple[str, dict, tuple[str, ...]]] = []
        self.defs: dict[str, Any] = {}

    def run(self) -> None:
        self._emit("", self.refs.root, (), True)
        while self.queue:
            pointer, node, scope = self.queue.pop()
            self._emit(pointer, node, scope, True)
        if self.defs:
            self.refs.root.setdefault("$defs", {}).update(self.defs)

    def _affected(self, found: dict) -> set[str]:
        """The pointers from which a path-dependent dynamic reference is reached."""
        edges: dict[str, set[str]] = {}
        for pointer, node in subschemas(self.original):
            if not isinstance(node, dict):
                continue
            out = edges.setdefault(pointer, set())
            out.update(p for p, _ in children(node, pointer) if not _into_definitions(p, pointer))
            for keyword in _KEYWORDS:
                out.update(found.get((pointer, keyword), ()))
                if self.statics.get((pointer, keyword)) is not None:
                    out.add(self.statics[(pointer, keyword)])
        affected = {pointer for pointer, _ in self.multi}
        changed = True
        while changed:
            changed = False
            for pointer, targets in edges.items():
                if pointer not in affected and targets & affected:
                    affected.add(pointer)
                    changed = True
        return affected

    def _emit(self, pointer: str, node: Any, scope: tuple[str, ...], reached: bool) -> None:
        """Write the references of ``node`` (the subschema at ``pointer`` of the original, or a
        copy of it) for dynamic ``scope``; ``reached``: the walk follows evaluation (not a
        definition container, whose references only a copy can tell)."""
        base = self.refs.base_at(pointer)
        scope = scope if base in scope else (*scope, base)
        if not isinstance(node, dict):
            return
        for child_pointer, child in list(children(node, pointer)):
            self._emit(child_pointer, child, scope, reached and not _into_definitions(child_pointer, pointer))
        for keyword in _KEYWORDS:
            key = (pointer, keyword)
            if key not in self.statics or keyword not in node:
                continue
            target = self._target(key, scope, reached)
            if target is None:
                self.refs.ambiguous = True
            else:  # a definition no path evaluates as it stands may refer anywhere: no copy
                _write(node, keyword, self._link(target, scope) if reached else _fragment(target))

    def _target(self, key: tuple[str, str], scope: tuple[str, ...], reached: bool) -> str | None:
        if key in self.multi and reached:
            return self.refs.resolve_dynamic(key, self.names[key], scope, self.statics[key])
        return self.single.get(key, self.statics[key])

    def _link(self, target: str, scope: tuple[str, ...]) -> str:
        """The reference to ``target`` reached with ``scope``: its copy for that scope when
        the scope matters there, else the subschema itself."""
        if target not in self.affected:
            return _fragment(target)
        base = self.refs.base_at(target)
        scope = scope if base in scope else (*scope, base)
        name = self.copies.get((target, scope))
        if name is None:
            if len(self.copies) >= MAX_COPIES:
                raise self.refs._refuse(next(iter(self.multi)), f"its dynamic scopes need more than {MAX_COPIES}"
                                                                " copies of the schemas that lead to it")
            name = self.copies[(target, scope)] = f"{DYNAMIC_PREFIX}{len(self.copies)}"
            node = copy.deepcopy(at_pointer(self.original, target))
            self.defs[name] = node
            self.queue.append((target, node, scope))
        return _fragment(f"/$defs/{name}")


def _into_definitions(child: str, parent: str) -> bool:
    return child.startswith((f"{parent}/$defs/", f"{parent}/definitions/"))
