"""JSON-schema checks and rewrites before any backend sees a schema.

* ``check_schema``: metaschema validation (InvalidConstraintError with a JSON pointer), a
  size budget (ConstraintTooLargeError) and ``$ref`` resolution (``check_refs``).
* ``rewrite_schema``: turns keywords the backends skip into enforceable equivalents
  (oneOf with disjoint branches -> anyOf, ``not`` of simple forms, if/then/else with a
  negatable ``if``, dependencies -> anyOf, annotation-only keywords dropped). Anything that
  cannot be rewritten stays, so a strict backend rejects it instead of half-enforcing it.
* ``xgrammar_gaps``: keywords of a (rewritten) schema that xgrammar would not enforce.
* ``normalise_schema``: runs first: integer keywords written as floats (``maxLength: 2.0``)
  become integers, and every ``pattern`` / ``patternProperties`` regex gets its ECMA-262
  meaning made explicit (:mod:`constraints.regex_dialect`), so no backend reads it differently.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator
from urllib.parse import unquote

from .errors import ConstraintTooLargeError, InvalidConstraintError, UnsupportedConstraintError

MAX_NODES = 100_000
MAX_DEPTH = 100
MAX_ENUM = 10_000
MAX_COMPLEMENT_CHARS = 2_000  # literals negated into a regex

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# formats llguidance enforces; others are annotations (JSON Schema: format does not assert by default)
ENFORCED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
# formats the JSON Schema drafts define: validators may assert them, so they are never dropped;
# any other format name is a pure annotation (no validator can check it) and is dropped, and so
# is draft-03's "utc-millisec": it gives a number a meaning (milliseconds since 1970) and
# allows every number
SPEC_FORMATS = ENFORCED_FORMATS | frozenset(
    {"idn-email", "idn-hostname", "uri-reference", "iri", "iri-reference", "uri-template",
     "json-pointer", "relative-json-pointer", "regex", "ip-address", "host-name", "color",
     "style", "phone", "duration"}
)


_UCSCHAR = [(0xA0, 0xD7FF), (0xF900, 0xFDCF), (0xFDF0, 0xFFEF)] + [
    (plane, plane + 0xFFFD) for plane in range(0x10000, 0xE0000, 0x10000)] + [(0xE1000, 0xEFFFD)]
_IPRIVATE = [(0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD)]


def _char_class(chars: str, extra: list[tuple[int, int]] = ()) -> str:
    """A class of the ASCII ``chars`` and the ranges ``extra``, every member written as an
    escape (xgrammar reads a bare ``$`` in a class as an anchor)."""
    from .regex_dialect import class_items

    ranges = sorted({(ord(c), ord(c)) for c in chars} | set(extra))
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return f"[{class_items(merged)}]"


def _uri_pattern(iri: bool, reference: bool) -> str:
    """RFC 3986's ``URI`` / ``URI-reference`` or RFC 3987's ``IRI`` / ``IRI-reference``
    (``iri``: ``ucschar`` is unreserved, ``iprivate`` allowed in the query) as a regex.
    An IPv4 address is one spelling of a reg-name, so ``host`` is an IP literal or a reg-name."""
    alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    unreserved, sub_delims = alnum + "-._~", "!$&'()*+,;="
    wide = _UCSCHAR if iri else []
    pct = "%[0-9A-Fa-f]{2}"

    def chars(extra: str, more: list[tuple[int, int]] = ()) -> str:
        return f"(?:{_char_class(unreserved + sub_delims + extra, wide + list(more))}|{pct})"

    pchar = chars(":@")
    segment, segment_nz = f"{pchar}*", f"{pchar}+"
    segment_nz_nc = f"{chars('@')}+"
    query = f"{chars(':@/?', _IPRIVATE if iri else [])}*"
    fragment = f"{chars(':@/?')}*"
    h16, dec = "[0-9A-Fa-f]{1,4}", "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ls32 = rf"(?:{h16}:{h16}|{dec}(?:\.{dec}){{3}})"
    ipv6 = "|".join([rf"(?:{h16}:){{6}}{ls32}", rf"::(?:{h16}:){{5}}{ls32}", rf"(?:{h16})?::(?:{h16}:){{4}}{ls32}"]
                    + [rf"(?:(?:{h16}:){{0,{n}}}{h16})?::(?:{h16}:){{{3 - n}}}{ls32}" for n in (1, 2)]
                    + [rf"(?:(?:{h16}:){{0,3}}{h16})?::{h16}:{ls32}", rf"(?:(?:{h16}:){{0,4}}{h16})?::{ls32}",
                       rf"(?:(?:{h16}:){{0,5}}{h16})?::{h16}", rf"(?:(?:{h16}:){{0,6}}{h16})?::"])
    ipvfuture = rf"v[0-9A-Fa-f]+\.{_char_class(unreserved + sub_delims + ':')}+"
    host = rf"(?:\[(?:{ipv6}|{ipvfuture})\]|{chars('')}*)"
    authority = f"(?:{chars(':')}*@)?{host}(?::[0-9]*)?"
    path_abempty = f"(?:/{segment})*"
    tail = rf"(?:\?{query})?(?:#{fragment})?"
    absolute = (f"[A-Za-z][A-Za-z0-9+.-]*:(?://{authority}{path_abempty}|/(?:{segment_nz}{path_abempty})?"
                f"|{segment_nz}{path_abempty}|){tail}")
    if not reference:
        return f"^{absolute}$"
    relative = (f"(?://{authority}{path_abempty}|/(?:{segment_nz}{path_abempty})?"
                f"|{segment_nz_nc}{path_abempty}|){tail}")
    return f"^(?:{absolute}|{relative})$"


def _uri_template_pattern() -> str:
    """RFC 6570's URI-Template (section 2) as a regex: literals (any character but controls,
    space and ``"'%<>\\^`{|}``, non-ASCII only from ``ucschar``/``iprivate``, or a
    percent-encoding) and ``{op varspec,...}`` expressions (names of ``[A-Za-z0-9_]`` or
    percent-encodings, dot-separated; a ``:1-9999`` prefix or ``*`` explode modifier)."""
    pct = "%[0-9A-Fa-f]{2}"
    ascii_literals = [(0x21, 0x21), (0x23, 0x24), (0x26, 0x26), (0x28, 0x3B), (0x3D, 0x3D), (0x3F, 0x5B),
                      (0x5D, 0x5D), (0x5F, 0x5F), (0x61, 0x7A), (0x7E, 0x7E)]
    literal = f"{_char_class('', ascii_literals + _UCSCHAR + _IPRIVATE)}|{pct}"
    varchar = rf"(?:[A-Za-z0-9_]|{pct})"
    varspec = rf"{varchar}(?:\.?{varchar})*(?::[1-9][0-9]{{0,3}}|\*)?"
    expression = rf"\{{[+#./;?&=,!@|]?{varspec}(?:,{varspec})*\}}"
    return rf"^(?:{literal}|{expression})*$"


# spec formats enforced through an exact pattern instead
FORMAT_PATTERNS = {
    "uri-reference": _uri_pattern(iri=False, reference=True),
    "iri": _uri_pattern(iri=True, reference=False),
    "iri-reference": _uri_pattern(iri=True, reference=True),
    "json-pointer": r"^(/([^~/]|~[01])*)*$",
    "relative-json-pointer": r"^(0|[1-9][0-9]*)(#|(/([^~/]|~[01])*)*)$",
    "uri-template": _uri_template_pattern(),
}
FORMAT_ALIASES = {"ip-address": "ipv4", "host-name": "hostname"}  # draft-03 names
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
     "$schema", "$id", "id", "contentMediaType", "contentEncoding", "$anchor", "nullable", "example",
     "markdownDescription", "x-intellij-html-description", "enumDescriptions", "markdownEnumDescriptions"}
)
# keywords xgrammar 0.2 enforces (conservative: anything else is a gap)
XGRAMMAR_ENFORCED = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
     "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
     "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
) | ANNOTATIONS

_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST_KEYS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_KEYS = ("not", "if", "then", "else", "additionalProperties", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _esc(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def subschemas(node: Any, pointer: str = "") -> Iterator[tuple[str, Any]]:
    """(pointer, subschema) for ``node`` and every schema nested in it, depth first."""
    yield pointer, node
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAP_KEYS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from subschemas(sub, f"{pointer}/{key}/{_esc(name)}")
    for key in _SCHEMA_LIST_KEYS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from subschemas(sub, f"{pointer}/{key}/{i}")
    for key in _SCHEMA_KEYS:
        if isinstance(node.get(key), (dict, bool)):
            yield from subschemas(node[key], f"{pointer}/{key}")
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield from subschemas(sub, f"{pointer}/items/{i}")
    elif isinstance(items, (dict, bool)):
        yield from subschemas(items, f"{pointer}/items")
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                yield from subschemas(sub, f"{pointer}/dependencies/{_esc(name)}")


# -- normalisation --------------------------------------------------------------------------------

# keywords whose value must be a non-negative integer in every draft
INTEGER_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties",
                    "maxContains", "minContains")


def normalise_schema(schema: dict) -> dict:
    """A copy of ``schema`` that every backend reads the same way: ``2.0`` in an integer keyword
    becomes ``2`` (backends silently skip a float bound), regexes get ECMA-262 classes, and in
    drafts 3 to 7 the keywords beside a ``$ref`` are dropped (those drafts ignore them; the
    backends would apply them).

    A non-integral value (``maxLength: 2.5``) is an InvalidConstraintError naming the keyword and
    its JSON pointer. The input is not modified.
    """
    _check_size(schema)  # bounds the recursion below
    out = copy.deepcopy(schema)
    legacy_ref = _ref_overrides_siblings(out)
    for pointer, node in list(subschemas(out)):
        if isinstance(node, dict):
            if legacy_ref and "$ref" in node:
                for key in REF_IGNORED_SIBLINGS.intersection(node):
                    del node[key]
            _integer_keywords(node, pointer)
            _ecma_patterns(node)
    _anchor_refs_to_pointers(out)
    return out


def _anchor_refs_to_pointers(schema: Any) -> None:
    """``{"$ref": "#name"}`` naming a plain-name fragment (``$anchor``, or an ``$id``/``id``
    of ``"#name"`` as drafts 3 to 7 write it) becomes the JSON pointer of that subschema: the
    same subschema, in the one reference form every backend resolves. A name given to two
    subschemas is left alone."""
    where: dict[str, str | None] = {}
    for pointer, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        names = {node[k][1:] for k in ("$id", "id") if isinstance(node.get(k), str) and node[k].startswith("#")}
        if isinstance(node.get("$anchor"), str):
            names.add(node["$anchor"])
        for name in names - {""}:
            where[name] = None if name in where else pointer
    if not where:
        return
    for _, node in subschemas(schema):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#") and "/" not in ref and where.get(ref[1:]) is not None:
            node["$ref"] = "#" + where[ref[1:]]


# assertion and applicator keywords that drafts 3-7 ignore beside "$ref" ("All other properties
# in a "$ref" object MUST be ignored", draft-07 core section 8.3); definitions and unknown keys
# stay, since a JSON pointer may still lead through them
REF_IGNORED_SIBLINGS = frozenset(
    {"type", "properties", "required", "additionalProperties", "patternProperties", "items",
     "additionalItems", "prefixItems", "enum", "const", "anyOf", "allOf", "oneOf", "not", "if", "then",
     "else", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
     "maxLength", "pattern", "format", "minItems", "maxItems", "uniqueItems", "contains",
     "minProperties", "maxProperties", "dependencies", "propertyNames", "disallow", "extends",
     "divisibleBy"}
)
_LEGACY_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


def _ref_overrides_siblings(schema: Any) -> bool:
    """True when the root's ``$schema`` names draft 3, 4, 6 or 7 (no ``$schema``: the latest
    draft, where keywords beside ``$ref`` apply)."""
    return names_draft(schema, _LEGACY_DRAFTS)


def names_draft(root: Any, drafts: tuple[str, ...]) -> bool:
    """Whether the root's ``$schema`` names one of ``drafts`` (``"draft-04"``, ``"2019-09"``, ...)."""
    uri = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(uri, str) and any(d in uri for d in drafts)


def _integer_keywords(node: dict, pointer: str) -> None:
    for key in INTEGER_KEYWORDS:
        value = node.get(key)
        if not isinstance(value, float):
            continue
        if not value.is_integer():
            raise InvalidConstraintError(
                f"invalid JSON schema at {pointer}/{key}: {key} must be an integer, got {value!r}",
                pointer=f"{pointer}/{key}",
                keyword=key,
            )
        node[key] = int(value)


def _ecma_patterns(node: dict) -> None:
    from .regex_dialect import ecma_regex

    if isinstance(node.get("pattern"), str):
        node["pattern"] = ecma_regex(node["pattern"], json_string=True)
    props = node.get("patternProperties")
    if isinstance(props, dict):
        merged: dict[str, Any] = {}
        for key, sub in props.items():
            key = ecma_regex(key, json_string=True)
            # "\\d" and "[0-9]" become the same key: a name matching it must satisfy both
            merged[key] = {"allOf": [merged[key], sub]} if key in merged else sub
        node["patternProperties"] = merged


# -- validation and budget ------------------------------------------------------------------------


def check_schema(schema: dict) -> None:
    """Metaschema check, size budget and $ref resolution; raises InvalidConstraintError /
    ConstraintTooLargeError / UnsupportedConstraintError."""
    _check_size(schema)
    check_refs(schema)
    import jsonschema
    from jsonschema.exceptions import best_match

    cls = jsonschema.validators.validator_for(schema)
    meta = cls(cls.META_SCHEMA)
    for exc in meta.iter_errors(schema):
        if exc.validator == "uniqueItems" and exc.path and exc.path[-1] in _DEDUPABLE:
            continue  # duplicate enum/required/type members change nothing
        exc = best_match([exc]) or exc
        pointer = "/" + "/".join(_esc(str(p)) for p in exc.path) if exc.path else ""
        keyword = str(exc.path[-1]) if exc.path else None
        raise InvalidConstraintError(
            f"invalid JSON schema at {pointer or '/'}: {exc.message[:200]}",
            pointer=pointer or "/",
            keyword=keyword,
        ) from None


_DEDUPABLE = frozenset({"enum", "required", "type"})


def check_refs(schema: Any) -> None:
    """Every ``$ref`` must point into this schema: a JSON pointer (``#/$defs/a``), an
    ``$anchor`` (``#name``) or a subschema's ``$id``. A dangling one is an
    InvalidConstraintError, a remote one an UnsupportedConstraintError (never fetched, never
    compiled as "anything goes"); both name the reference and where it is."""
    ids, anchors = _ids_and_anchors(schema)
    for pointer, node in subschemas(schema):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if ref is None:
            continue
        where = f"{pointer}/$ref" if pointer else "/$ref"
        if not isinstance(ref, str):
            raise InvalidConstraintError(f"$ref at {where} must be a string", pointer=where, keyword="$ref")
        base, _, fragment = ref.partition("#")
        if base and base not in ids:
            raise UnsupportedConstraintError(
                f"$ref {ref!r} at {where} is not a reference into this schema "
                "(remote and relative references are not fetched)",
                pointer=where,
                keyword="$ref",
            )
        target = ids.get(base, schema) if base else schema
        if not _fragment_resolves(target, fragment, anchors):
            raise InvalidConstraintError(
                f"$ref {ref!r} at {where} does not resolve to a subschema", pointer=where, keyword="$ref"
            )


def _ids_and_anchors(schema: Any) -> tuple[dict[str, Any], set[str]]:
    ids: dict[str, Any] = {}
    anchors: set[str] = set()
    for _, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        for key in ("$id", "id"):
            if isinstance(node.get(key), str) and node[key]:
                ids[node[key].partition("#")[0] or node[key]] = node
        if isinstance(node.get("$anchor"), str):
            anchors.add(node["$anchor"])
        if isinstance(node.get("$id"), str) and node["$id"].startswith("#"):
            anchors.add(node["$id"][1:])  # draft-06/07 plain-name fragments
    return ids, anchors


def _fragment_resolves(root: Any, fragment: str, anchors: set[str]) -> bool:
    if not fragment:
        return True
    if not fragment.startswith("/"):
        return fragment in anchors
    return isinstance(at_pointer(root, fragment), (dict, bool))


def pointer_parts(pointer: str) -> list[str]:
    """The reference tokens of JSON pointer ``pointer`` (``/a/b``, URI-escaped or not)."""
    return [unquote(part).replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]


def at_pointer(document: Any, pointer: str) -> Any:
    """The value at JSON pointer ``pointer`` (``/a/b``, URI-escaped or not), or None."""
    for part in pointer_parts(pointer):
        if isinstance(document, dict) and part in document:
            document = document[part]
        elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
            document = document[int(part)]
        else:
            return None
    return document


def _depth(node: Any, limit: int) -> int:
    # iterative: a 10k-deep schema must not hit Python's recursion limit
    best, stack = 0, [(node, 1)]
    while stack:
        cur, d = stack.pop()
        if d > best:
            best = d
            if best > limit:
                return best
        if isinstance(cur, dict):
            stack.extend((v, d + 1) for v in cur.values() if isinstance(v, (dict, list)))
        elif isinstance(cur, list):
            stack.extend((v, d + 1) for v in cur if isinstance(v, (dict, list)))
    return best


def _check_size(schema: dict) -> None:
    if _depth(schema, 2 * MAX_DEPTH) > 2 * MAX_DEPTH:  # a schema level is ~2 JSON levels
        raise ConstraintTooLargeError(f"schema nesting exceeds {MAX_DEPTH} levels", keyword="depth")
    count = 0
    for pointer, node in subschemas(schema):
        count += 1
        if count > MAX_NODES:
            raise ConstraintTooLargeError(f"schema has more than {MAX_NODES} subschemas")
        if isinstance(node, dict) and isinstance(node.get("enum"), list) and len(node["enum"]) > MAX_ENUM:
            raise ConstraintTooLargeError(
                f"enum at {pointer or '/'} has {len(node['enum'])} members (limit {MAX_ENUM})",
                pointer=pointer or "/",
                keyword="enum",
            )


# -- rewriting -------------------------------------------------------------------------------------


def rewrite_schema(schema: dict) -> dict:
    """An equivalent schema with fewer keywords that backends skip (input is not modified)."""
    from .regex_complement import forget_complements

    forget_complements()
    try:
        return _Rewriter(hoist_ref_targets(copy.deepcopy(schema))).run()
    except RecursionError:  # cyclic $refs through negation: leave the schema to the backends
        return copy.deepcopy(schema)


# keywords whose subschemas the rewrite replaces (a ``not`` negated, a ``oneOf`` turned into an
# ``anyOf``, ``if``/``then``/``else`` spelled out, ...): a JSON pointer through them may lead
# nowhere afterwards, or to another subschema
_REWRITTEN_KEYWORDS = frozenset(
    {"not", "oneOf", "anyOf", "allOf", "if", "then", "else", "dependencies", "dependentSchemas",
     "contains", "propertyNames"}
)
HOISTED_PREFIX = "trellis-ref-"


def hoist_ref_targets(schema: dict) -> dict:
    """``schema`` (changed in place) with each subschema that a local ``$ref`` reaches through a
    rewritten keyword (``#/allOf/1/not``) copied, as written, to ``$defs`` and the reference
    pointed there. The copy means the same; the pointer now survives the rewrite. Left alone
    when a nested ``$id`` moves the base URI (a copy would resolve its references elsewhere)."""
    if any(pointer and isinstance(node, dict) and any(isinstance(node.get(k), str) for k in ("$id", "id"))
           for pointer, node in subschemas(schema)):
        return schema
    original: Any = None  # the schema as written, copied once a reference needs it
    names: dict[str, str] = {}
    while True:
        moved = False
        for _, node in list(subschemas(schema)):
            ref = node.get("$ref") if isinstance(node, dict) else None
            if not isinstance(ref, str) or not ref.startswith("#/"):
                continue
            if not _REWRITTEN_KEYWORDS.intersection(pointer_parts(ref[1:])):
                continue
            if original is None:
                original = copy.deepcopy(schema)
            target = at_pointer(original, ref[1:])
            if target is None:
                continue  # unresolvable: check_refs names it
            if ref not in names:
                names[ref] = f"{HOISTED_PREFIX}{len(names)}"
                schema.setdefault("$defs", {})[names[ref]] = copy.deepcopy(target)
            node["$ref"] = f"#/$defs/{names[ref]}"
            moved = True
        if not moved:
            return schema


class _Rewriter:
    def __init__(self, root: dict) -> None:
        self.root = root

    def run(self) -> dict:
        result = self.node(self.root)
        if result is False:
            return {"anyOf": [False]}
        if isinstance(result, dict):
            self._unlisted_ref_targets(result)
        return result if isinstance(result, dict) else {}

    def _unlisted_ref_targets(self, result: dict) -> None:
        """Rewrite the subschemas a local ``$ref`` reaches under a key that is no schema
        keyword (``{"$ref": "#/my_defs/a"}``): the walk above does not visit them."""
        done: set[str] = set()
        while True:
            listed = {id(n) for _, n in subschemas(result)}
            todo = []
            for _, n in subschemas(result):
                ref = n.get("$ref") if isinstance(n, dict) else None
                if isinstance(ref, str) and ref.startswith("#/") and ref not in done:
                    todo.append(ref)
            for ref in todo:
                done.add(ref)
                parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
                parent: Any = result
                for part in parts[:-1]:
                    parent = parent.get(part) if isinstance(parent, dict) else None
                if isinstance(parent, dict) and isinstance(parent.get(parts[-1]), dict) \
                        and id(parent[parts[-1]]) not in listed:
                    parent[parts[-1]] = self.node(parent[parts[-1]])
            if not todo:
                return

    def node(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = self._not_as_written(node)
        if not isinstance(node, dict):
            return node
        self._children(node)
        steps = (self._drop_annotations, self._not, self._one_of, self._dependencies, self._if_then_else, self._coverage)
        for step in steps:
            node = step(node)
            if not isinstance(node, dict):
                return node
        return node

    def _children(self, node: dict) -> None:
        for key in _SCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {k: self.node(v) for k, v in node[key].items()}
        for key in _SCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [self.node(v) for v in node[key]]
        for key in _SCHEMA_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = self.node(node[key])
        if isinstance(node.get("items"), dict):
            node["items"] = self.node(node["items"])
        elif isinstance(node.get("items"), list):
            node["items"] = [self.node(v) for v in node["items"]]
        if isinstance(node.get("dependencies"), dict):
            node["dependencies"] = {
                k: self.node(v) if isinstance(v, dict) else v for k, v in node["dependencies"].items()
            }

    # each step: node -> node | bool

    @staticmethod
    def _drop_annotations(node: dict) -> Any:
        if node.get("uniqueItems") is False or (
            node.get("uniqueItems") is True and isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1
        ):
            node.pop("uniqueItems")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_ALIASES:
            node["format"] = fmt = FORMAT_ALIASES[fmt]
        if isinstance(fmt, str) and fmt in FORMAT_PATTERNS:
            if "pattern" in node:
                node = conjoin(node, {"pattern": FORMAT_PATTERNS[fmt]}, ("format",))
            else:
                node = {("pattern" if k == "format" else k): (FORMAT_PATTERNS[fmt] if k == "format" else v)
                        for k, v in node.items()}
        elif fmt is not None and fmt not in SPEC_FORMATS:
            node.pop("format")
        if node.get("propertyNames") in ({"type": "string"}, {}, True):
            node.pop("propertyNames")
        for key in ("if", "then", "else"):
            if node.get(key) in ({}, True) and key != "if":
                node.pop(key)
        if "if" in node and "then" not in node and "else" not in node:
            node.pop("if")
        return node

    def _coverage(self, node: dict) -> Any:
        from .schema_coverage import rewrite_coverage

        return rewrite_coverage(node, self.root, negate)

    def _not_as_written(self, node: dict) -> Any:
        """``not`` negated before its subschema is rewritten, where that is expressible: a
        rewrite can turn a negatable form (``not: {const: "a"}`` under ``propertyNames``)
        into one that is not. Otherwise :meth:`_not` tries again after the rewrites."""
        if "not" not in node:
            return node
        neg = negate(node["not"], self.root)
        if neg is None:
            return node
        return conjoin(node, copy.deepcopy(neg), ("not",))

    def _not(self, node: dict) -> Any:
        if "not" not in node:
            return node
        neg = negate(node["not"], self.root)
        if neg is None:
            return node
        return conjoin(node, neg, ("not",))

    def _one_of(self, node: dict) -> Any:
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            return node
        live = [b for b in branches if b is not False]
        if len(live) <= 1 or pairwise_disjoint(live, self.root):
            return conjoin(node, {"anyOf": live} if live else False, ("oneOf",))
        if objects_only_disjoint(live, self.root):
            return conjoin(node, {"type": "object", "anyOf": live}, ("oneOf",))
        if strings_only_disjoint(live, self.root):
            return conjoin(node, {"type": "string", "anyOf": live}, ("oneOf",))
        exclusive = exactly_one(live, self.root)
        if exclusive is not None:
            return conjoin(node, exclusive, ("oneOf",))
        return node

    @staticmethod
    def _dependencies(node: dict) -> Any:
        extra: list[Any] = []
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            deps = node.get(key)
            if not isinstance(deps, dict):
                continue
            for name, dep in deps.items():
                absent = {"properties": {name: False}}
                if isinstance(dep, list):
                    present: Any = {"required": list(dict.fromkeys([name, *dep]))}
                elif dep is True or dep == {}:
                    continue
                else:
                    present = {"allOf": [{"required": [name]}, dep]}
                extra.append({"anyOf": [absent, present]})
        keys = ("dependencies", "dependentRequired", "dependentSchemas")
        replaced = tuple(k for k in keys if isinstance(node.get(k), dict))
        if not replaced:
            return node
        return conjoin(_after_properties(node, replaced), _all_of(extra) if extra else True, replaced)

    def _if_then_else(self, node: dict) -> Any:
        if "if" not in node:
            return node
        cond = node["if"]
        neg = negate(cond, self.root)
        if neg is None:
            return node
        then, other = node.get("then", True), node.get("else", True)
        branches = [b for b in (_all_of([cond, then]), _all_of([neg, other])) if b is not False]
        return conjoin(node, {"anyOf": branches} if branches else False, ("if", "then", "else"))


def _after_properties(node: dict, keys: tuple[str, ...]) -> dict:
    """``node`` with ``keys`` moved right behind ``properties`` (when it has one): a dependency
    names properties the object declares, and llguidance orders an object's properties by
    where the keywords naming them sit, so ``{"dependencies": {"b": {"required": ["c"]}},
    "properties": {"a", "b", "c"}}`` would otherwise make ``c`` come before ``a`` (MaskBench
    Github_medium o62823)."""
    if "properties" not in node:
        return node
    out: dict = {}
    for key, value in node.items():
        if key in keys:
            continue
        out[key] = value
        if key == "properties":
            out.update((k, node[k]) for k in keys)
    return out


MAX_ONE_OF_NEGATED = 6


def exactly_one(branches: list[Any], root: dict) -> Any:
    """oneOf as anyOf over "this branch and no other", when every branch can be negated."""
    if len(branches) > MAX_ONE_OF_NEGATED:
        return None
    negs = [negate(b, root) for b in branches]
    if any(n is None for n in negs):
        return None
    options = []
    for i, branch in enumerate(branches):
        option = _all_of([branch, *(negs[j] for j in range(len(branches)) if j != i)])
        if option is not False:
            options.append(option)
    return {"anyOf": options} if options else False


def _all_of(parts: list[Any]) -> Any:
    parts = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in parts):
        return False
    if not parts:
        return {}
    return parts[0] if len(parts) == 1 else {"allOf": parts}


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


# -- negation --------------------------------------------------------------------------------------


def _resolve(node: Any, root: dict, depth: int = 0) -> Any:
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


def _meaningful(node: dict) -> dict:
    return {k: v for k, v in node.items() if k not in ANNOTATIONS}


def negate(schema: Any, root: dict) -> Any:
    """A schema accepting exactly the instances ``schema`` rejects, or None when not expressible."""
    schema = _resolve(schema, root)
    if schema is True:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return None
    s = _meaningful(schema)
    if not s:
        return False
    if "$ref" in s:
        return None
    parts = []
    for key in list(s):
        neg = _negate_keyword(key, s, root)
        if neg is None:
            return None
        parts.append(neg)
    # not (A and B) = (not A) or (not B); keyword groups are handled together by _negate_keyword
    parts = [p for p in parts if p is not _SKIP]
    if any(p is True for p in parts):
        return True
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_SKIP = object()


def _type_list(value: Any) -> list[str] | None:
    types = [value] if isinstance(value, str) else value
    if not isinstance(types, list) or not all(t in ALL_TYPES for t in types):
        return None
    out = set(types)
    if "number" in out:
        out.add("integer")
    return sorted(out)


def _negate_keyword(key: str, s: dict, root: dict) -> Any:
    value = s[key]
    if key == "type":
        types = _type_list(value)
        if types is None:
            return None
        rest = [t for t in ALL_TYPES if t not in types and t != "integer"]
        if "integer" in types and "number" not in types:
            return None  # "number but not integer" needs multipleOf negation
        return {"type": rest} if rest else False
    if key == "required" and isinstance(value, list):
        if not value:
            return False
        return _only_objects([{"properties": {k: False}} for k in value])
    if key == "properties" and isinstance(value, dict):
        branches = []
        for name, sub in value.items():
            neg = negate(sub, root)
            if neg is None:
                return None
            if neg is not False:
                branches.append({"required": [name], "properties": {name: neg}})
        return _only_objects(branches) if branches else False
    if key == "pattern" and isinstance(value, str):  # strings it matches nowhere
        from .regex_complement import complement_pattern

        other = complement_pattern(value)
        return None if other is None else {"type": "string", "pattern": other}
    if key in ("const", "enum"):
        values = [value] if key == "const" else value
        if not isinstance(values, list):
            return None
        return _not_values(values)
    if key == "anyOf" and isinstance(value, list):
        negs = [negate(b, root) for b in value]
        if any(n is None for n in negs):
            return None
        return _all_of(negs)
    if key == "allOf" and isinstance(value, list):
        negs = [negate(b, root) for b in value]
        if any(n is None for n in negs):
            return None
        negs = [n for n in negs if n is not False]
        if any(n is True for n in negs):
            return True
        return {"anyOf": negs} if negs else False
    if key == "not":  # double negation
        return value
    if key == "propertyNames":
        return _negate_property_names(value, root)
    if key == "patternProperties" and isinstance(value, dict):
        return _negate_pattern_properties(value, root)
    if key == "items" and isinstance(value, (dict, bool)) and "prefixItems" not in s:
        neg = negate(value, root)  # some item fails: contains the negation
        return None if neg is None else False if neg is False else {"type": "array", "contains": neg}
    if key == "contains" and not {"minContains", "maxContains"} & set(s):
        neg = negate(value, root)  # no item matches: every item fails
        return None if neg is None else {"type": "array", "items": neg}
    if key in _BOUND_NEGATIONS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _negate_bound(key, value)
    if key not in SPEC_KEYWORDS:  # no draft defines it: an annotation, true of every instance
        return _SKIP
    return None


def before_draft_06(root: dict) -> bool:
    """Whether the root's ``$schema`` names draft 3 or 4, where ``contains``, ``const`` and
    ``propertyNames`` are no keywords (llguidance's JSON compiler then skips them)."""
    return names_draft(root, ("draft-03", "draft-04"))


# every keyword some JSON Schema draft gives a meaning (assertions, applicators, identifiers)
SPEC_KEYWORDS = REF_IGNORED_SIBLINGS | ANNOTATIONS | frozenset(
    {"$ref", "$defs", "definitions", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
     "unevaluatedItems", "contentSchema", "$dynamicRef", "$recursiveRef", "$dynamicAnchor",
     "$recursiveAnchor", "$vocabulary", "minContains", "maxContains", "extends", "disallow", "divisibleBy",
     "optional", "requires"}
)


def finite_names(schema: Any, root: dict) -> list[str] | None:
    """The strings ``schema`` accepts, when they are few and known (``const`` / ``enum``, or a
    ``pattern`` anchored at both ends with a finite language), else None. Non-string values
    are left out: used for property names, which are strings."""
    from .regex_analysis import finite_strings

    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return [] if schema is False else None
    s = _meaningful(schema)
    if s.get("type", "string") != "string":
        return None
    rest = set(s) - {"type", "const", "enum", "pattern"}
    if rest:
        return None
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list):
            return None
        names = [v for v in values if isinstance(v, str)]
        if "pattern" in s:
            import re

            try:
                names = [v for v in names if re.search(s["pattern"], v)]
            except re.error:
                return None
        return list(dict.fromkeys(names))
    if isinstance(s.get("pattern"), str):
        return finite_strings(s["pattern"])
    return None


def _negate_property_names(value: Any, root: dict) -> Any:
    """not {propertyNames: N}: an object with a name N rejects; expressible when the rejected
    names are few and known (N = false: any name; N = not X with X a finite name set)."""
    value = _resolve(value, root)
    if value is False:
        return {"type": "object", "minProperties": 1}
    if value is True or not isinstance(value, dict):
        return False if value is True else None
    s = _meaningful(value)
    if not s:
        return False
    if set(s) != {"not"}:
        return None
    names = finite_names(s["not"], root)
    if names is None:
        return None
    return _only_objects([{"required": [n]} for n in names])


def _negate_pattern_properties(value: dict, root: dict) -> Any:
    """not {patternProperties}: some property whose name matches a pattern has a value that
    pattern's schema rejects; expressible when each pattern names a few known strings."""
    from .regex_analysis import finite_strings

    branches = []
    for pattern, sub in value.items():
        names = finite_strings(pattern)
        neg = negate(sub, root)
        if names is None or neg is None:
            return None
        if neg is not False:
            branches.extend({"required": [n], "properties": {n: neg}} for n in names)
    return _only_objects(branches)


_BOUND_NEGATIONS = {
    "maxLength": ("string", "minLength", 1),
    "minLength": ("string", "maxLength", -1),
    "maxItems": ("array", "minItems", 1),
    "minItems": ("array", "maxItems", -1),
    "minimum": ("number", "exclusiveMaximum", 0),
    "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0),
    "exclusiveMaximum": ("number", "minimum", 0),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}


def _negate_bound(key: str, value: float) -> Any:
    """not {minLength: 3} = strings shorter than 3 (other types always satisfy the keyword)."""
    type_, other, shift = _BOUND_NEGATIONS[key]
    bound = value + shift
    if shift and (not float(value).is_integer() or bound < 0):
        return False if bound < 0 else None
    if other == "maxProperties" and bound == 0:  # the empty object, in a form backends enforce
        return {"type": "object", "additionalProperties": False}
    return {"type": type_, other: int(bound) if shift else value}


def _only_objects(branches: list[Any]) -> Any:
    # an object-keyword schema accepts every non-object, so its negation is objects only
    if not branches:
        return False
    inner = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {"type": "object", "allOf": [inner]}


def _not_values(values: list[Any]) -> Any:
    """Everything except the given literals (strings, booleans, null; not numbers or containers)."""
    strings = [v for v in values if isinstance(v, str)]
    bools = {v for v in values if isinstance(v, bool)}
    if any(not (v is None or isinstance(v, (str, bool))) for v in values):
        return None
    if sum(len(v) for v in strings) > MAX_COMPLEMENT_CHARS:
        return None
    kept = [t for t in ("object", "array", "number") ]
    branches: list[Any] = [{"type": kept}]
    if None not in values:
        branches.append({"type": "null"})
    if not bools:
        branches.append({"type": "boolean"})
    elif len(bools) == 1:
        branches.append({"enum": [not next(iter(bools))]})  # const is unknown to draft-04 (ignored there)
    if strings:
        branches.append({"type": "string", "pattern": "^" + complement_regex(strings) + "$"})
    else:
        branches.append({"type": "string"})
    return {"anyOf": branches}


_CLASS_META = set("\\]^-[")
_REGEX_META = set("\\.+*?()|[]{}^$")
_ANY = r"[\s\S]"


def complement_regex(words: list[str]) -> str:
    """Regex (unanchored body) matching every string except the given ones."""
    trie: dict = {}
    for w in words:
        cur = trie
        for ch in w:
            cur = cur.setdefault(ch, {})
        cur[""] = {}
    return _complement(trie)


def _complement(node: dict) -> str:
    alts = []
    if "" not in node:
        alts.append("")
    kids = [c for c in node if c]
    if kids:
        cls = "".join("\\" + c if c in _CLASS_META else c for c in sorted(kids))
        alts.append(f"[^{cls}]{_ANY}*")
    else:
        alts.append(f"{_ANY}+")
    for c in sorted(kids):
        lit = "\\" + c if c in _REGEX_META else c
        alts.append(lit + _complement(node[c]))
    return "(?:" + "|".join(alts) + ")"


# -- disjointness ----------------------------------------------------------------------------------


def _literal_values(node: dict) -> list[Any] | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"integer", "number"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    return {"object"}


def _possible_types(node: Any, root: dict, depth: int = 0) -> set[str]:
    node = _resolve(node, root)
    if node is False:
        return set()
    if not isinstance(node, dict) or depth > 16:
        return set(ALL_TYPES)
    types = set(ALL_TYPES)
    declared = _type_list(node.get("type")) if "type" in node else None
    if declared is not None:
        types &= set(declared) | ({"number"} if "integer" in declared else set())
    lits = _literal_values(node)
    if lits is not None:
        types &= set().union(*(_json_types(v) for v in lits)) if lits else set()
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            types &= set().union(*(_possible_types(b, root, depth + 1) for b in node[key])) if node[key] else set()
    if isinstance(node.get("allOf"), list):
        for b in node["allOf"]:
            types &= _possible_types(b, root, depth + 1)
    if isinstance(node.get("$ref"), str) and len(node) > 1:
        types &= _possible_types({"$ref": node["$ref"]}, root, depth + 1)
    return types


def _discriminators(node: Any, root: dict, depth: int = 0) -> dict[str, tuple[list[Any], bool]]:
    """Properties with literal values (const/enum) -> (values, required)."""
    node = _resolve(node, root)
    if not isinstance(node, dict) or depth > 8:
        return {}
    out: dict[str, tuple[list[Any], bool]] = {}
    req = set(node.get("required") or [])
    for name, sub in (node.get("properties") or {}).items():
        sub = _resolve(sub, root)
        if isinstance(sub, dict):
            lits = _literal_values(sub)
            if lits is not None:
                out[name] = (lits, name in req)
    for part in node.get("allOf") or []:
        for name, (lits, required) in _discriminators(part, root, depth + 1).items():
            if name in out:
                out[name] = (out[name][0], out[name][1] or required)
            else:
                out[name] = (lits, required or name in req)
    return out


def _canon(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _disjoint(a: Any, b: Any, root: dict) -> bool:
    ta, tb = _possible_types(a, root), _possible_types(b, root)
    if not ta & tb:
        return True
    ra, rb = _resolve(a, root), _resolve(b, root)
    if isinstance(ra, dict) and isinstance(rb, dict):
        la, lb = _literal_values(ra), _literal_values(rb)
        if la is not None and lb is not None and not ({_canon(v) for v in la} & {_canon(v) for v in lb}):
            return True
        if ta & tb <= {"string"} and _patterns_exclude(ra, rb):
            return True
        if ta & tb <= {"object"}:
            da, db = _discriminators(ra, root), _discriminators(rb, root)
            for name in set(da) & set(db):
                (va, ra_), (vb, rb_) = da[name], db[name]
                if (ra_ or rb_) and not ({_canon(v) for v in va} & {_canon(v) for v in vb}):
                    return True
            if _closed_exclusion(ra, rb, root) or _closed_exclusion(rb, ra, root):
                return True
    return False


def _patterns_exclude(a: dict, b: dict) -> bool:
    """No string matches both patterns (then no string satisfies both schemas)."""
    pa, pb = a.get("pattern"), b.get("pattern")
    if not (isinstance(pa, str) and isinstance(pb, str)):
        return False
    from .pattern_disjoint import patterns_disjoint

    return patterns_disjoint(pa, pb)


def _closed_exclusion(a: dict, b: dict, root: dict) -> bool:
    """a requires a property that b forbids (b closed via additionalProperties: false)."""
    if b.get("additionalProperties") is not False or b.get("patternProperties"):
        return False
    allowed = set((b.get("properties") or {}).keys())
    return any(name not in allowed for name in a.get("required") or [])


OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
     "maxProperties", "dependencies", "dependentRequired", "dependentSchemas", "propertyNames"}
)


def objects_only_disjoint(branches: list[Any], root: dict) -> bool:
    """True when every branch (two or more) constrains objects only, with no ``type``, and no
    object can match two of them: a non-object then matches every branch, so ``oneOf`` means
    "an object matching one branch" (a discriminated union written without ``type``)."""
    typed = []
    for branch in branches:
        if not isinstance(branch, dict) or not set(_meaningful(branch)) <= OBJECT_KEYWORDS:
            return False
        typed.append({**branch, "type": "object"})
    return len(typed) >= 2 and pairwise_disjoint(typed, root)


STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "format"})


def strings_only_disjoint(branches: list[Any], root: dict) -> bool:
    """True when every branch (two or more) constrains strings only, with no ``type``, and no
    string can match two of them: a non-string then matches every branch, so ``oneOf`` means
    "a string matching one branch" (``oneOf`` of patterns under ``type: string``)."""
    typed = []
    for branch in branches:
        if not isinstance(branch, dict) or not set(_meaningful(branch)) <= STRING_KEYWORDS:
            return False
        typed.append({**branch, "type": "string"})
    return len(typed) >= 2 and pairwise_disjoint(typed, root)


def pairwise_disjoint(branches: list[Any], root: dict) -> bool:
    """True when no instance can match two of the branches (so oneOf == anyOf)."""
    return all(
        _disjoint(branches[i], branches[j], root)
        for i in range(len(branches))
        for j in range(i + 1, len(branches))
    )


# -- xgrammar coverage -----------------------------------------------------------------------------


def xgrammar_gaps(schema: Any) -> list[tuple[str, str]]:
    """(pointer, keyword) for every keyword xgrammar would not enforce."""
    gaps = []
    for pointer, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        for key in node:
            if key not in XGRAMMAR_ENFORCED:
                gaps.append((pointer or "/", key))
        if "pattern" in node:  # xgrammar drops length bounds next to a pattern
            gaps.extend((pointer or "/", k) for k in ("minLength", "maxLength") if k in node)
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(node.get(key), bool):  # draft-04 form
                gaps.append((pointer or "/", key))
    return gaps


def open_property_count(schema: Any) -> str | None:
    """Pointer of the first object whose ``minProperties`` could be met only with keys that are
    not listed and required (pattern-matched or additional ones), else None. llguidance takes such
    a key twice and counts the repeat, so ``{"x": 1, "x": 2}`` meets ``minProperties: 2`` and
    parses to a one-key object, and a closed set of pattern keys can leave it with no way on."""
    for pointer, node in subschemas(schema):
        if not isinstance(node, dict):
            continue
        low = node.get("minProperties")
        if not isinstance(low, (int, float)) or isinstance(low, bool):
            continue
        props, required = node.get("properties", {}), node.get("required", [])
        listed = set(props) if isinstance(props, dict) else set()
        sure = len(listed & set(required)) if isinstance(required, list) else 0
        open_keys = bool(node.get("patternProperties")) or node.get("additionalProperties", True) is not False
        if low > max(sure, 1) and open_keys:
            return pointer or "/"
    return None


def find_keyword(schema: Any, keyword: str, value: Any = None) -> str | None:
    """Pointer of the first subschema using ``keyword`` (with ``value``, when one is given)."""
    for pointer, node in subschemas(schema):
        if isinstance(node, dict) and keyword in node and (value is None or node[keyword] == value):
            return pointer or "/"
    return None
