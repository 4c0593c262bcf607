"""JSON-schema checks and rewrites before any backend sees a schema.

* ``check_schema``: metaschema validation (InvalidConstraintError with a JSON pointer), a
  size budget (ConstraintTooLargeError) and ``$ref`` resolution (``check_refs``).
* ``rewrite_schema``: turns keywords the backends skip into enforceable equivalents
  (oneOf with disjoint branches -> anyOf, ``not`` of simple forms, if/then/else with a
  negatable ``if``, dependencies -> anyOf, annotation-only keywords dropped, ``format`` as an
  exact pattern or refused, numeric keywords decided on exact decimals). Anything that cannot
  be rewritten stays, so a strict backend rejects it instead of half-enforcing it.
* ``xgrammar_gaps``: keywords of a (rewritten) schema that xgrammar would not enforce.
* ``normalise_schema``: runs first: integer keywords written as floats (``maxLength: 2.0``)
  become integers, and every ``pattern`` / ``patternProperties`` regex goes through the regex
  front end (:mod:`constraints.regex.frontend`): ECMA-262 meaning made explicit, anchors,
  lookarounds and word boundaries resolved exactly (or refused), so no backend reads it
  differently; every reference is resolved inside the document and written as a JSON pointer
  (:mod:`.references`).

The rewrites build on the modules beside this one: the keyword vocabulary (:mod:`.keywords`),
the format patterns (:mod:`.formats`), exact numbers (:mod:`.numbers`), negation
(:mod:`.negation`), disjointness (:mod:`.disjoint`) and the exact rewrites of :mod:`.coverage`.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ConstraintTooLargeError, EmptyLanguageError, InvalidConstraintError, UnsupportedConstraintError
from ..regex.complement import forget_complements
from ..regex.frontend import anchors_at_edges, schema_pattern
from .coverage import rewrite_coverage
from .disjoint import objects_only_disjoint, pairwise_disjoint, possible_types, strings_only_disjoint
from .formats import REFUSED_FORMATS, format_keywords
from .keywords import (ANNOTATIONS, DRAFT3_ONLY_FORMATS, FORMAT_ALIASES, LATER_DRAFTS, REF_IGNORED_SIBLINGS, SPEC_FORMATS,
                       XGRAMMAR_ENFORCED)
from .negation import all_of, exactly_one, negate
from .numbers import rewrite_numbers
from .object_difference import exclusive_objects
from .one_of_parts import exclusive_parts
from .pattern_regions import disjoint_pattern_properties
from .references import check_references, inline_boolean_refs, resolve_references
from .type_pruning import prune_typed_branches
from .tree import (SCHEMA_KEYS, SCHEMA_LIST_KEYS, SCHEMA_MAP_KEYS, at_pointer, conjoin, escape_part, names_draft,
                   pointer_parts, subschemas)

MAX_NODES = 100_000
MAX_DEPTH = 100
MAX_ENUM = 10_000


# -- normalisation --------------------------------------------------------------------------------

# keywords whose value must be a non-negative integer in every draft
INTEGER_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties",
                    "maxContains", "minContains")


def normalise_schema(schema: dict) -> dict:
    """A copy of ``schema`` that every backend reads the same way: ``2.0`` in an integer keyword
    becomes ``2`` (backends silently skip a float bound), regexes get ECMA-262 classes, and in
    drafts 3 to 7 the keywords beside a ``$ref`` are dropped (those drafts ignore them; the
    backends would apply them); references become JSON pointers from the root.

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
            _ecma_patterns(node, pointer, out)
    return resolve_references(out)


_LEGACY_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


def _ref_overrides_siblings(schema: Any) -> bool:
    """True when the root's ``$schema`` names draft 3, 4, 6 or 7 (no ``$schema``: the latest
    draft, where keywords beside ``$ref`` apply)."""
    return names_draft(schema, _LEGACY_DRAFTS)


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


def _ecma_patterns(node: dict, pointer: str, root: dict) -> None:
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        regex = schema_pattern(pattern, f"pattern at {pointer or '/'}", f"{pointer}/pattern")
        if regex is None:
            _empty_pattern(node, pointer, root)
        else:
            node["pattern"] = regex
    props = node.get("patternProperties")
    if isinstance(props, dict):
        merged: dict[str, Any] = {}
        for key, sub in props.items():
            where = f"{pointer}/patternProperties/{escape_part(key)}"
            regex = schema_pattern(key, f"patternProperties name at {where}", where)
            if regex is None:
                continue  # a pattern no name matches: its schema applies to no property
            # "\\d" and "[0-9]" become the same key: a name matching it must satisfy both
            merged[regex] = {"allOf": [merged[regex], sub]} if regex in merged else sub
        node["patternProperties"] = merged


_NOT_STRING = ["null", "boolean", "object", "array", "number"]


def _empty_pattern(node: dict, pointer: str, root: dict) -> None:
    """A ``pattern`` no string matches: the node takes no string (other types still fit). When
    it can only be a string and every instance reaches it, nothing fits the schema: the
    refusal a regex matching no string gets."""
    pattern = node.pop("pattern")
    if node.get("type") in ("string", ["string"]) and _always_reached(root, pointer):
        raise EmptyLanguageError(f"the pattern {pattern!r} at {pointer or '/'} matches no string",
                                 pointer=f"{pointer}/pattern", keyword="pattern")
    others = node.setdefault("allOf", [])
    if isinstance(others, list):  # else the schema check that follows names the malformed allOf
        others.append({"type": list(_NOT_STRING)})


def _always_reached(root: dict, pointer: str) -> bool:
    """Whether every instance of ``root`` has a value that the subschema at ``pointer`` must
    describe: the path goes only through ``allOf``, required properties of objects and the
    items of non-empty arrays."""
    node: Any = root
    parts = pointer_parts(pointer) if pointer else []
    while parts:
        key = parts.pop(0)
        if key == "allOf" and parts and parts[0].isdigit() and isinstance(node.get("allOf"), list):
            node = node["allOf"][int(parts.pop(0))]
        elif key == "properties" and parts and node.get("type") == "object" and parts[0] in node.get("required", []):
            node = node["properties"][parts.pop(0)]
        elif key == "items" and node.get("type") == "array" and isinstance(node.get("items"), dict) \
                and node.get("minItems", 0) >= 1:
            node = node["items"]
        else:
            return False
        if not isinstance(node, dict):
            return False
    return True


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
        pointer = "/" + "/".join(escape_part(str(p)) for p in exc.path) if exc.path else ""
        keyword = str(exc.path[-1]) if exc.path else None
        raise InvalidConstraintError(
            f"invalid JSON schema at {pointer or '/'}: {exc.message[:200]}",
            pointer=pointer or "/",
            keyword=keyword,
        ) from None


_DEDUPABLE = frozenset({"enum", "required", "type"})


def check_refs(schema: Any) -> None:
    """Every ``$ref`` must point into this schema (see :mod:`.references`): a dangling one is an
    InvalidConstraintError, a remote one an UnsupportedConstraintError (never fetched, never
    compiled as "anything goes"); both name the reference and where it is."""
    check_references(schema)


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
            inline_boolean_refs(result)  # a target the rewrite turned into true / false
            result = prune_typed_branches(result)
        return result if isinstance(result, dict) else {}

    def _unlisted_ref_targets(self, result: dict) -> None:
        """Rewrite the subschemas a local ``$ref`` reaches under a key that is no schema
        keyword (``{"$ref": "#/my_defs/a"}``): the walk above does not visit them."""
        done: set[str] = set()
        reached: list[dict] = [result]  # the schema and the unlisted targets rewritten so far
        while True:
            walked = [n for base in reached for _, n in subschemas(base)]
            listed = {id(n) for n in walked}  # rewritten already
            todo = []
            for n in walked:  # references inside a rewritten target lead on too
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
                    if isinstance(parent[parts[-1]], dict):
                        reached.append(parent[parts[-1]])
            if not todo:
                return

    def node(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = self._not_as_written(node)
        if not isinstance(node, dict):
            return node
        self._children(node)
        steps = (self._drop_annotations, self._numbers, self._not, self._one_of, self._dependencies, self._if_then_else,
                 self._coverage, disjoint_pattern_properties, self._typeless)
        for step in steps:
            node = step(node)
            if not isinstance(node, dict):
                return node
        return node

    def _children(self, node: dict) -> None:
        for key in SCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                node[key] = {k: self.node(v) for k, v in node[key].items()}
        for key in SCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                node[key] = [self.node(v) for v in node[key]]
        for key in SCHEMA_KEYS:
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

    def _drop_annotations(self, node: dict) -> Any:
        if node.get("uniqueItems") is False or (
            node.get("uniqueItems") is True and isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1
        ):
            node.pop("uniqueItems")
        node = self._format(node)
        if node.get("propertyNames") in ({"type": "string"}, {}, True):
            node.pop("propertyNames")
        cond = node.get("if")
        if isinstance(cond, dict) and not set(cond) - ANNOTATIONS - {"$defs", "definitions"}:
            node.pop("if")  # an if that asserts nothing always holds: its then applies
            node.pop("else", None)
            node = conjoin(node, node.pop("then", True))
            if node is False:
                return False
        for key in ("if", "then", "else"):
            if node.get(key) in ({}, True) and key != "if":
                node.pop(key)
        if "if" in node and "then" not in node and "else" not in node:
            node.pop("if")
        if "if" not in node:  # then and else without an if are ignored
            node.pop("then", None)
            node.pop("else", None)
        return node

    def _format(self, node: dict) -> dict:
        """``format`` as the exact keywords of :mod:`.formats` (in its place); a format some
        draft defines with no exact form is refused by name, any other name dropped."""
        fmt = node.get("format")
        if not isinstance(fmt, str):
            return node
        if fmt in DRAFT3_ONLY_FORMATS and names_draft(self.root, LATER_DRAFTS):
            node.pop("format")  # a name the schema's draft does not define: an annotation
            return node
        fmt = FORMAT_ALIASES.get(fmt, fmt)
        exact = format_keywords(fmt)
        if exact is None:
            if fmt in SPEC_FORMATS:
                pointer = find_keyword(self.root, "format", node["format"]) or "/"
                why = REFUSED_FORMATS.get(fmt, "no grammar defines it")
                raise UnsupportedConstraintError(f"format {fmt!r} at {pointer} is not supported for enforcement:"
                                                 f" {why}", pointer=pointer, keyword="format")
            node.pop("format")
            return node
        if any(k in node for k in exact):
            return conjoin(node, dict(exact), ("format",))
        out: dict = {}
        for key, value in node.items():
            out.update(exact if key == "format" else {key: value})
        return out

    def _numbers(self, node: dict) -> Any:
        return rewrite_numbers(node, lambda: self._pointer_of(node))

    def _pointer_of(self, node: dict) -> str:
        """Where ``node`` sits in the schema being rewritten (for a message; "" when unknown)."""
        return next((p for p, n in subschemas(self.root) if n is node), "")

    def _typeless(self, node: dict) -> Any:
        """False for a node no value of any type can satisfy (``type: object`` beside an
        ``anyOf`` of strings, say: llguidance refuses such a subschema even where an instance
        never reaches it); :func:`.disjoint.possible_types` only ever widens the types."""
        return node if possible_types(node, self.root) else False

    def _coverage(self, node: dict) -> Any:
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
        # the instances in question satisfy the keywords beside the oneOf too: branches need
        # be exclusive only among those (a discriminating property required beside them)
        context = {k: node[k] for k in ("type", "required", "properties") if k in node}
        if len(live) <= 1 or pairwise_disjoint(live, self.root, context):
            return conjoin(node, {"anyOf": live} if live else False, ("oneOf",))
        if objects_only_disjoint(live, self.root, context):
            return conjoin(node, {"type": "object", "anyOf": live}, ("oneOf",))
        if strings_only_disjoint(live, self.root, context):
            return conjoin(node, {"type": "string", "anyOf": live}, ("oneOf",))
        # closed objects listing no name in common share {} alone: oneOf is anyOf without it
        # when two branches or more accept it
        if pairwise_disjoint(live, self.root, context, empty_object=True):
            form = self._without_shared_empty({"anyOf": live}, live, context)
            if form is not None:
                return conjoin(node, form, ("oneOf",))
        if objects_only_disjoint(live, self.root, context, empty_object=True):
            form = self._without_shared_empty({"type": "object", "anyOf": live}, live, context)
            if form is not None:
                return conjoin(node, form, ("oneOf",))
        exclusive = exactly_one(live, self.root)
        if exclusive is None:  # object branches that overlap: each less what the others take
            exclusive = exclusive_objects(live, self.root, context)
        if exclusive is None:  # groups of overlapping branches, or untyped object branches
            exclusive = exclusive_parts(live, self.root, context)
        if exclusive is not None:
            return conjoin(node, exclusive, ("oneOf",))
        return node

    def _without_shared_empty(self, form: dict, branches: list[Any], context: dict) -> dict | None:
        """``form`` (the branches as an ``anyOf``), with ``minProperties: 1`` when two branches
        or more accept ``{}`` (beside ``context``): {} then matches more than one branch, and any
        other object at most one. None when a branch cannot be checked against {}."""
        from .validation import instance_validator

        draft = self.root.get("$schema") if isinstance(self.root.get("$schema"), str) else None
        accepting = 0
        for branch in branches:
            schema: dict = {"allOf": [context, branch]}
            if draft:
                schema["$schema"] = draft
            valid = instance_validator(schema, self.root)
            if valid is None:
                return None
            try:
                accepting += bool(valid({}))
            except Exception:  # nothing is proven
                return None
        return {**form, "minProperties": 1} if accepting >= 2 else form

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
        return conjoin(_after_properties(node, replaced), all_of(extra) if extra else True, replaced)

    def _if_then_else(self, node: dict) -> Any:
        if "if" not in node:
            return node
        cond = node["if"]
        neg = negate(cond, self.root)
        if neg is None:
            return node
        then, other = node.get("then", True), node.get("else", True)
        branches = [b for b in (all_of([cond, then]), all_of([neg, other])) if b is not False]
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


def before_draft_06(root: dict) -> bool:
    """Whether the root's ``$schema`` names draft 3 or 4, where ``contains``, ``const`` and
    ``propertyNames`` are no keywords (llguidance's JSON compiler then skips them)."""
    return names_draft(root, ("draft-03", "draft-04"))


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
        # xgrammar ignores anchors: one inside a pattern (left as written when too large to resolve)
        if isinstance(node.get("pattern"), str) and not anchors_at_edges(node["pattern"]):
            gaps.append((pointer or "/", "pattern"))
        if isinstance(node.get("patternProperties"), dict) and not all(map(anchors_at_edges, node["patternProperties"])):
            gaps.append((pointer or "/", "patternProperties"))
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(node.get(key), bool):  # draft-04 form
                gaps.append((pointer or "/", key))
        gaps.extend((pointer or "/", key) for key in _untyped_keywords(node))
    return gaps


_TYPED_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                             "exclusiveMaximum"})


def _untyped_keywords(node: dict) -> list[str]:
    """The string and number keywords of ``node`` that xgrammar skips: it applies them only
    beside a ``type`` (``{"pattern": "^a$"}`` takes any value, ``{"enum": [1, 2], "minimum": 2}``
    takes 1)."""
    return [] if "type" in node else sorted(_TYPED_KEYWORDS.intersection(node))


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
