"""Strict JSON schemas as llguidance Lark grammars, for what no JSON-Schema form expresses.

llguidance's JSON compiler refuses ``contains`` (and ``minContains`` / ``maxContains``); the
exact rewrites of :mod:`constraints.schema.coverage` spell it out only for arrays of at most a
few items. A Lark grammar expresses it on arrays of any length: the array is written as
``"[" element (", " element)* "]"`` by a right-linear grammar whose states count the elements
and, per ``contains`` clause, the elements matching it, so the language is exactly

* every element matches ``items`` (all of them, when several parts of the schema give one);
* at least ``minContains`` (default 1) elements match ``contains``, and at most ``maxContains``:
  with a ``maxContains`` each element is either a match or a non-match (``items`` and the
  negated ``contains``, which must have an exact form: :func:`constraints.schema.negation.negate`);
* ``minItems`` / ``maxItems``.

Each element class is a rule of its own: an ``%json { … }`` embed of the JSON schema when it
needs no grammar (llguidance's own JSON compiler enforces it, with the request's layout passed
as ``x-guidance`` and the local references it reaches copied beside it), or a rule built the
same way when it holds a ``contains`` itself. llguidance cannot embed a Lark rule inside a JSON
schema, so the whole schema is emitted as Lark once any node needs it; the nodes above a
``contains`` may be ``$ref`` / ``allOf`` / ``anyOf`` (and ``type`` alternatives beside the
array), ``items`` and object properties: an object one of whose properties (or
``additionalProperties``) holds a ``contains`` is written as rules too
(:mod:`constraints.schema.lark_objects`: ``properties``, ``required``, ``additionalProperties``,
keys in the declared order). Anything else above one (``patternProperties``, a ``not`` or
``oneOf`` over one, ``prefixItems``, ``uniqueItems``) is refused by name. The layout is the
request's: ``", "`` / ``": "`` (``json.dumps``), ``","`` / ``":"`` (compact) or the flexible
whitespace pattern between the tokens written here.

Lark syntax: llguidance's docs/syntax.md ("Inline JSON Schemas").
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import EmptyLanguageError
from .lark_objects import OBJECT_KEYS, ObjectLayout, object_body, refuse as _refuse
from .validation import instance_validator, same_json
from .negation import negate
from .tree import at_pointer, resolve, subschemas

MAX_STATES = 512  # counting states of one array rule (elements x matches per clause)
MAX_CLAUSES = 4  # contains clauses on one array (element classes: 2 ** clauses)
MAX_ALTERNATIVES = 64  # branches an anyOf over a contains may distribute into
MAX_RULES = 2_000

_ARRAY_KEYS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                         "contains", "minContains", "maxContains", "unevaluatedItems"})
# keywords that apply to arrays and that the array rule cannot take beside a contains
_ARRAY_REFUSED = ("prefixItems", "uniqueItems", "unevaluatedItems", "not", "oneOf", "if", "then", "else",
                  "$dynamicRef", "$recursiveRef", "extends", "disallow")
_LEGACY_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")  # no minContains / maxContains
ALL_BUT_ARRAY = ["null", "boolean", "object", "number", "string"]


@dataclass(frozen=True)
class LarkSchema:
    """A (rewritten) strict JSON schema that the llguidance backend compiles through
    :func:`lark_grammar` instead of its JSON-schema compiler."""

    schema: Any


def needs_lark(schema: Any) -> bool:
    """Whether some subschema of ``schema`` holds a ``contains`` (which llguidance's JSON
    compiler refuses)."""
    return any(isinstance(sub, dict) and "contains" in sub for _, sub in subschemas(schema))


def lark_grammar(schema: Any, json_options: dict[str, Any], satisfiable: Callable[[Any], bool]) -> str:
    """The Lark grammar of ``schema``; ``json_options`` are llguidance's JSON options (the
    layout), ``satisfiable(schema)`` tells whether llguidance compiles an embedded schema to a
    non-empty language (False when it reports it unsatisfiable; it raises for other errors).

    Raises UnsupportedConstraintError naming the keyword that has no exact form here, or
    EmptyLanguageError when no instance is valid."""
    emitter = _Emitter(schema if isinstance(schema, dict) else {}, json_options, satisfiable)
    start = emitter.rule(schema)
    if start is None:
        raise EmptyLanguageError("no JSON value satisfies the schema")
    lines = [f"start: {start}"]
    if emitter.ws:
        lines.append(f"WS: /{emitter.ws}/")
    lines += [f"{name}: {body}" for name, body in emitter.rules.items()]
    return "\n".join(lines) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


@dataclass
class _Clause:
    schema: Any  # what an element must match to count
    low: int
    high: int | None
    miss: Any = None  # the negated schema, when high is set


class _Emitter:
    def __init__(self, root: dict, json_options: dict[str, Any], satisfiable: Callable[[Any], bool]) -> None:
        self.root = root
        self.options = {k: v for k, v in json_options.items() if k != "lenient"}
        self.satisfiable = satisfiable
        self.rules: dict[str, str] = {}
        self._names: dict[str, str | None] = {}  # canonical schema -> rule name (None: empty)
        draft = root.get("$schema") if isinstance(root.get("$schema"), str) else ""
        self.legacy = any(d in draft for d in _LEGACY_DRAFTS)
        self._layout()

    def _layout(self) -> None:
        if self.options.get("whitespace_flexible"):
            pattern = self.options.get("whitespace_pattern") or r"[\x20\x0A\x0D\x09]*"
            self.ws = pattern.replace("/", "\\/")
            self.open, self.sep, self.close = '"[" WS', 'WS "," WS', 'WS "]"'
            self.object_layout = ObjectLayout('"{" WS', 'WS "}"', self.sep, 'WS ":" WS')
        else:
            self.ws = ""
            sep = self.options.get("item_separator", ",")
            self.open, self.sep, self.close = '"["', _lark_string(sep), '"]"'
            colon = _lark_string(self.options.get("key_separator", ":"))
            self.object_layout = ObjectLayout('"{"', '"}"', self.sep, colon)

    # -- rules ---------------------------------------------------------------------------------

    def rule(self, schema: Any) -> str | None:
        """The name of a rule matching exactly ``schema``'s instances (None: no instance)."""
        key = json.dumps(schema, sort_keys=True)
        if key in self._names:
            return self._names[key]
        name = f"r{len(self._names)}"
        if len(self._names) >= MAX_RULES:
            raise _refuse("contains", f"the grammar would need more than {MAX_RULES} rules")
        self._names[key] = name  # a recursive $ref reaches the name before the body exists
        body = self._body(schema) if self._special(schema) else self._embed(schema)
        if body is None:
            self._names[key] = None
            return None
        self.rules[name] = body
        return name

    def _embed(self, schema: Any) -> str | None:
        """``%json`` of a schema llguidance's JSON compiler enforces, with the root's
        definitions beside it when it refers to them."""
        if schema is False:
            return None
        out = dict(schema) if isinstance(schema, dict) else {}
        if _has_ref(out):
            document = _Hoisted(self.root).document(out)
            if document is None:
                raise _refuse("$ref", "a reference beside a contains must be local (and no nested $id may move the base)")
            out = document
        if "$schema" in self.root and "$schema" not in out:
            out["$schema"] = self.root["$schema"]
        out["x-guidance"] = self.options
        if not self.satisfiable(out):
            return None
        return "%json " + json.dumps(out)

    def _special(self, schema: Any) -> bool:
        """Whether ``schema`` reaches a ``contains`` (through its subschemas and local $refs)."""
        seen: set[str] = set()
        stack = [schema]
        while stack:
            for _, sub in subschemas(stack.pop()):
                if not isinstance(sub, dict):
                    continue
                if "contains" in sub:
                    return True
                ref = sub.get("$ref")
                if isinstance(ref, str) and ref not in seen:
                    seen.add(ref)
                    stack.append(resolve({"$ref": ref}, self.root))
        return False

    def _body(self, schema: dict) -> str | None:
        """The rule body of a schema that reaches a contains: its conjunction of parts, the
        anyOf branches distributed, each alternative an array rule (and a %json of the other
        types it allows)."""
        alternatives = self._alternatives(self._parts(schema, 0))
        names = [n for n in (self._conjunction(parts) for parts in alternatives) if n is not None]
        return " | ".join(dict.fromkeys(names)) or None

    def _parts(self, node: Any, depth: int) -> list[Any]:
        """``node`` as a list of schemas that all hold: allOf members and $ref targets inlined."""
        if depth > 32:
            raise _refuse("$ref", "the references beside a contains nest too deeply (or cycle)")
        if not isinstance(node, dict):
            return [node]
        own = {k: v for k, v in node.items() if k not in ("allOf", "$ref", "definitions", "$defs")}
        parts: list[Any] = [own] if own else []
        if isinstance(node.get("$ref"), str):
            target = resolve({"$ref": node["$ref"]}, self.root)
            if isinstance(target, dict) and "$ref" in target and len(target) == 1:
                raise _refuse("$ref", f"{node['$ref']} does not resolve to a local schema")
            parts += self._parts(target, depth + 1)
        for member in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            parts += self._parts(member, depth + 1)
        return parts

    def _alternatives(self, parts: list[Any]) -> list[list[Any]]:
        """Conjunctions with no anyOf left: anyOf distributed over the other parts."""
        done: list[list[Any]] = []
        todo = [parts]
        while todo:
            conj = todo.pop()
            at = next((i for i, p in enumerate(conj) if isinstance(p, dict) and isinstance(p.get("anyOf"), list)), None)
            if at is None:
                done.append(conj)
                continue
            part = conj[at]
            rest = {k: v for k, v in part.items() if k != "anyOf"}
            before, after = conj[:at] + ([rest] if rest else []), conj[at + 1:]
            for branch in part["anyOf"]:  # in place: the parts' properties keep their declared order
                todo.append(before + self._parts(branch, 0) + after)
            if len(todo) + len(done) > MAX_ALTERNATIVES:
                raise _refuse("anyOf", f"distributing it over a contains gives more than {MAX_ALTERNATIVES} branches")
        return done

    def _conjunction(self, parts: list[Any]) -> str | None:
        """A rule for the instances of every schema in ``parts`` (no allOf, $ref or anyOf)."""
        if any(p is False for p in parts):
            return None
        parts = [p for p in parts if isinstance(p, dict) and p]
        for key in ("oneOf", "not", "if", "then", "else"):
            if any(key in p and self._special({key: p[key]}) for p in parts):
                raise _refuse(key, "a contains under it would need an exact complement")
        listed = self._listed(parts)
        if listed is not None:
            return listed
        # objects are written as rules where a contains lies below a property (else embedded)
        in_objects = self._special({"allOf": [{k: v for k, v in p.items() if k in OBJECT_KEYS} for p in parts]})
        kept = [{k: v for k, v in p.items() if k not in _ARRAY_KEYS and not (in_objects and k in OBJECT_KEYS)}
                for p in parts]
        types = [t for t in ALL_BUT_ARRAY if not (in_objects and t == "object")]
        others = [*filter(None, kept), {"type": types}]
        if self._special({"allOf": others}):
            raise _refuse("contains", "a contains is enforced only in arrays reached from the root through"
                                      " $ref, allOf, anyOf, items and object properties")
        names = [self._embed({"allOf": others}),
                 self._object(parts) if in_objects and _allows(parts, "object") else None,
                 self._array(parts) if _allows(parts, "array") else None]
        return self._alternation([n for n in names if n is not None])

    def _listed(self, parts: list[dict]) -> str | None:
        """With an enum / const among the parts: the listed values that satisfy every part."""
        values = next(([p["const"]] if "const" in p else p["enum"] for p in parts
                       if "const" in p or isinstance(p.get("enum"), list)), None)
        if values is None:
            return None
        schema = {"allOf": parts}
        if "$schema" in self.root:
            schema["$schema"] = self.root["$schema"]
        valid = instance_validator(schema, self.root)
        if valid is None:
            raise _refuse("enum", "its values could not be checked against the contains beside it")
        kept: list[Any] = []
        for v in values:
            if valid(v) and not any(same_json(v, w) for w in kept):
                kept.append(v)
        return self._name_of_body(self._embed({"enum": kept})) if kept else None

    def _alternation(self, names: list[str]) -> str | None:
        if not names:
            return None
        return names[0] if len(names) == 1 else self._name_of_body(" | ".join(names))

    def _name_of_body(self, body: str | None) -> str | None:
        if body is None:
            return None
        for name, existing in self.rules.items():
            if existing == body:
                return name
        name = f"b{len(self.rules)}"
        self.rules[name] = body
        return name

    def _terminal(self, body: str) -> str:
        """The name of a terminal (an uppercase rule: one lexeme) with this body."""
        for name, existing in self.rules.items():
            if existing == body and name.isupper():
                return name
        name = f"T{len(self.rules)}"
        self.rules[name] = body
        return name

    # -- objects -------------------------------------------------------------------------------

    def _object(self, parts: list[dict]) -> str | None:
        """The rule for the objects satisfying every part (one property holds a contains)."""
        body = object_body(parts, self.object_layout, lambda schemas: self.rule(_all_of(schemas)),
                           self._name_of_body, self._terminal)
        return self._name_of_body(body)

    # -- arrays --------------------------------------------------------------------------------

    def _array(self, parts: list[dict]) -> str | None:
        """The rule for the arrays satisfying every part."""
        for key in _ARRAY_REFUSED:
            if any(key in p for p in parts):
                raise _refuse(key, "it cannot be enforced beside a contains on an array of unbounded length")
        if any(isinstance(p.get("items"), list) for p in parts):
            raise _refuse("items", "an items list cannot be enforced beside a contains")
        items = [p["items"] for p in parts if "items" in p]
        if any(i is False for i in items):
            items = [False]
        low = max([p["minItems"] for p in parts if isinstance(p.get("minItems"), int)], default=0)
        highs = [p["maxItems"] for p in parts if isinstance(p.get("maxItems"), int)]
        high = min(highs) if highs else None
        clauses = [c for c in (self._clause(p) for p in parts if "contains" in p) if c is not None]
        if any(c is False for c in clauses):
            return None
        return self._counting(items, clauses, low, high)

    def _clause(self, part: dict) -> Any:
        """The part's contains clause (None: it holds for every array, False: for none)."""
        low, high = (1, None) if self.legacy else (part.get("minContains", 1), part.get("maxContains"))
        if not isinstance(low, int) or high is not None and not isinstance(high, int):
            raise _refuse("minContains", "its value is not an integer")
        if high is not None and high < low:
            return False
        if low == 0 and high is None:
            return None
        clause = _Clause(part["contains"], low, high)
        if high is not None:
            clause.miss = negate(part["contains"], self.root)
            if clause.miss is None:
                raise _refuse("maxContains", "the contains schema has no exact complement, so the items"
                                             " that do not match it cannot be told apart")
        return clause

    def _counting(self, items: list[Any], clauses: list[_Clause], low: int, high: int | None) -> str | None:
        """A right-linear grammar over states (elements so far, matches so far per clause)."""
        if len(clauses) > MAX_CLAUSES:
            raise _refuse("contains", f"more than {MAX_CLAUSES} contains clauses on one array")
        caps = [c.high if c.high is not None else c.low for c in clauses]
        length_cap = high if high is not None else low
        size = (length_cap + 1) * _product(cap + 1 for cap in caps)
        if size > MAX_STATES:
            raise _refuse("contains", f"counting its matches and the items needs more than {MAX_STATES} states")
        classes = self._classes(items, clauses)
        states = [(n, counts) for n in range(length_cap + 1)
                  for counts in itertools.product(*(range(cap + 1) for cap in caps))]

        def accepting(state: tuple[int, tuple[int, ...]]) -> bool:
            n, counts = state
            return n >= low and all(k >= c.low for k, c in zip(counts, clauses))

        def step(state: tuple[int, tuple[int, ...]], hits: tuple[int, ...]) -> Any:
            n, counts = state
            if high is not None and n >= high:
                return None
            new = []
            for k, c, hit, cap in zip(counts, clauses, hits, caps):
                k += hit
                if c.high is not None and k > c.high:
                    return None
                new.append(min(k, cap))
            return min(n + 1, length_cap), tuple(new)

        edges = {s: [(rule, t) for hits, rule in classes if (t := step(s, hits)) is not None] for s in states}
        live = _productive(states, edges, accepting)
        start = (0, tuple(0 for _ in clauses))
        if start not in live:
            return None
        names = {s: f"a{len(self.rules)}_{i}" for i, s in enumerate(sorted(live))}
        for s in sorted(live):
            options = [f"{self.sep} {rule} {names[t]}" for rule, t in edges[s] if t in live]
            if accepting(s):
                options.insert(0, self.close)
            self.rules[names[s]] = " | ".join(options)
        first = [f"{rule} {names[t]}" for rule, t in edges[start] if t in live]
        if accepting(start):
            first.insert(0, self.close)
        return self._name_of_body(f"{self.open} ({' | '.join(first)})")

    def _classes(self, items: list[Any], clauses: list[_Clause]) -> list[tuple[tuple[int, ...], str]]:
        """(which clauses an element counts for, its rule) per satisfiable element class. Without
        a maxContains an element need not count for a clause it matches (the grammar is then
        ambiguous, never wrong); with one, it counts exactly when it matches."""
        out = []
        for hits in itertools.product((0, 1), repeat=len(clauses)):
            parts = list(items)
            for hit, c in zip(hits, clauses):
                if hit:
                    parts.append(c.schema)
                elif c.high is not None:
                    parts.append(c.miss)
            rule = self.rule(_all_of(parts))
            if rule is not None:
                out.append((hits, rule))
        return out


def _all_of(parts: list[Any]) -> Any:
    parts = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in parts):
        return False
    return {} if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}


def _allows(parts: list[dict], kind: str) -> bool:
    """Whether every part's ``type`` (if any) allows ``kind`` ("array" or "object")."""
    for p in parts:
        types = p.get("type")
        if isinstance(types, str):
            types = [types]
        if isinstance(types, list) and kind not in types:
            return False
    return True


class _Hoisted:
    """A schema made a document of its own: each local reference it reaches (transitively)
    points to a copy of its target under ``$defs`` (only what is reached, wherever it lies in
    the root: each embed carries its own copies)."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.names: dict[str, str] = {}  # reference -> name of its copy
        self.copies: dict[str, Any] = {}

    def document(self, schema: dict) -> dict | None:
        out = self.rewritten(schema, top=True)
        if out is None:
            return None
        return {**out, "$defs": {**(out.get("$defs") or {}), **self.copies}} if self.copies else out

    def rewritten(self, schema: Any, top: bool = False) -> Any:
        """A copy of ``schema`` whose references point to hoisted copies (None: one cannot)."""
        out = json.loads(json.dumps(schema))
        for pointer, sub in subschemas(out):
            if not isinstance(sub, dict):
                continue
            if "$dynamicRef" in sub or "$recursiveRef" in sub or (pointer or not top) and (
                    "$id" in sub or isinstance(sub.get("id"), str)):
                return None
            if "$ref" in sub:
                name = self._hoist(sub["$ref"])
                if name is None:
                    return None
                sub["$ref"] = f"#/$defs/{name}"
        return out

    def _hoist(self, ref: Any) -> str | None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        if ref in self.names:
            return self.names[ref]
        target = at_pointer(self.root, ref[1:])
        if target is None:
            return None
        name = self.names[ref] = f"trellis-ref-{len(self.names)}"
        self.copies[name] = True  # reserved: a reference cycle reaches the name first
        copy = self.rewritten(target)
        if copy is None:
            return None
        self.copies[name] = copy
        return name


def _has_ref(schema: Any) -> bool:
    return any(isinstance(s, dict) and ("$ref" in s or "$dynamicRef" in s or "$recursiveRef" in s)
               for _, s in subschemas(schema))


def _product(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _productive(states: list, edges: dict, accepting: Callable[[Any], bool]) -> set:
    """The states from which an accepting state can be reached."""
    live = {s for s in states if accepting(s)}
    changed = True
    while changed:
        changed = False
        for s in states:
            if s not in live and any(t in live for _, t in edges[s]):
                live.add(s)
                changed = True
    return live
