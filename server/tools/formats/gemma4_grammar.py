"""A tool's ``parameters`` JSON Schema as an xgrammar EBNF grammar for Gemma 4's object notation.

Gemma 4 writes arguments as ``{key:<|"|>text<|"|>,n:3,flag:true,obj:{...},list:[...]}``: bare
keys, strings between ``<|"|>`` delimiters holding raw text (no escapes), numbers, booleans and
null as in JSON (Gemma 4's chat template, https://huggingface.co/google/gemma-4-31B-it; Google's
function-calling docs, https://ai.google.dev/gemma/docs/capabilities/function-calling). xgrammar
has no style for it, so this module writes the grammar itself, in one fixed layout (no
whitespace, properties in the schema's order, undeclared properties not generated: the same
choices as the JSON formats' grammar), so that every text it accepts is read back by
:func:`server.tools.formats.gemma4.to_json` as a value valid against the schema.

Input: a schema already rewritten by ``constraints.schema.analysis`` into the keywords xgrammar
enforces (type, properties, required, additionalProperties, items, prefixItems, min/maxItems,
enum, const, anyOf, $ref/$defs, min/maxLength, pattern, numeric bounds). Numeric leaves reuse
xgrammar's own JSON-Schema grammar (JSON and Gemma write numbers alike); a ``pattern`` becomes
xgrammar's regex grammar (a pattern that itself matches the delimiter text ``<|"|>`` would end
the string early: the parser then reads the call as text). What cannot be written exactly raises
:class:`UnsupportedSchema`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.memory import DERIVED_TEXT

QUOTE = '<|"|>'
_NUMERIC_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES = ("string", "number", "boolean", "null", "object", "array")  # "integer" is within "number"
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "$schema", "$id"})
_BAD_KEY = re.compile(r'[:{}\[\],"\\\x00-\x1f]')

# Text between the string delimiters: anything that does not contain the closing ``<|"|>``
# (a five-state automaton: g_textN = the last N characters are a prefix of the delimiter). A
# string with length bounds counts characters, which the automaton cannot do: there ``g_char``
# leaves out "|" (so the delimiter cannot occur; xgrammar's lookahead is not exact enough to
# leave out only "<|").
_FIXED_RULES = r"""
g_text ::= "" | [^<] g_text | "<" g_text1
g_text1 ::= "" | [^<|] g_text | "<" g_text1 | "|" g_text2
g_text2 ::= "" | [^<"] g_text | "<" g_text1 | "\"" g_text3
g_text3 ::= "" | [^<|] g_text | "<" g_text1 | "|" g_text4
g_text4 ::= "" | [^<>] g_text | "<" g_text1
g_char ::= [^|]
g_string ::= "<|\"|>" g_text "<|\"|>"
g_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
g_key ::= [^:{}\[\],"\\<\0-\x20]+
g_any ::= g_string | g_number | "true" | "false" | "null" | g_any_object | g_any_array
g_any_object ::= "{" "}" | "{" g_key ":" g_any ("," g_key ":" g_any)* "}"
g_any_array ::= "[" "]" | "[" g_any ("," g_any)* "]"
"""


class UnsupportedSchema(ValueError):
    """The schema (at ``pointer``) cannot be enforced in Gemma's notation."""

    def __init__(self, message: str, pointer: str) -> None:
        super().__init__(f"{message} (at {pointer or '/'})")
        self.pointer = pointer


def arguments_grammar(schema: dict[str, Any]) -> str:
    """EBNF (root rule ``root``) for an arguments object valid against ``schema``."""
    return _cached(json.dumps(schema))  # key order kept: it is the properties order


@DERIVED_TEXT.cached
def _cached(schema_text: str) -> str:
    builder = _Builder(json.loads(schema_text))
    root = builder.value(builder.root, "")
    return f"root ::= {root}\n" + "\n".join(f"{name} ::= {body}" for name, body in builder.rules.items()) + _FIXED_RULES


def notation(value: Any) -> str:
    """``value`` in Gemma's object notation (bare keys, ``<|"|>`` around strings, no spaces)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{notation(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(notation(v) for v in value) + "]"
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    return json.dumps(value)


def writable_key(key: str) -> bool:
    """Whether a property name can be written bare and read back unchanged."""
    return bool(key) and key == key.strip() and not _BAD_KEY.search(key) and QUOTE not in key


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


class _Builder:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}

    def rule(self, stem: str, body: str) -> str:
        name = f"g_{stem}_{len(self.rules)}"
        self.rules[name] = body
        return name

    # -- dispatch -----------------------------------------------------------------------------

    def value(self, schema: Any, pointer: str) -> str:
        """A rule name (or an inline EBNF expression) for values valid against ``schema``."""
        if schema is True or schema == {}:
            return "g_any"
        if schema is False or not isinstance(schema, dict):
            raise UnsupportedSchema("a schema no value satisfies", pointer)
        schema = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
        if "$ref" in schema:
            return self._ref(schema, pointer)
        if "const" in schema or "enum" in schema:
            return self._enum(schema, pointer)
        if "anyOf" in schema:
            return self._any_of(schema, pointer)
        kinds = schema.get("type", list(_TYPES))
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if "integer" in kinds and "number" in kinds:
            kinds.remove("integer")
        if not kinds:
            raise UnsupportedSchema("an empty 'type' list", pointer)
        alternatives = [self._typed(kind, schema, pointer) for kind in kinds]
        return alternatives[0] if len(alternatives) == 1 else self.rule("type", " | ".join(alternatives))

    def _typed(self, kind: str, schema: dict[str, Any], pointer: str) -> str:
        if kind == "string":
            return self._string(schema, pointer)
        if kind in ("integer", "number"):
            return self._number(kind, schema)
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "object":
            return self._object(schema, pointer)
        if kind == "array":
            return self._array(schema, pointer)
        raise UnsupportedSchema(f"unknown type {kind!r}", pointer)

    # -- keywords -----------------------------------------------------------------------------

    def _ref(self, schema: dict[str, Any], pointer: str) -> str:
        ref = schema["$ref"]
        if len(schema) > 1:
            raise UnsupportedSchema("keywords beside '$ref'", pointer)
        if ref in self.refs:
            return self.refs[ref]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema(f"$ref {ref!r} outside the schema", pointer)
        target: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise UnsupportedSchema(f"$ref {ref!r} does not resolve", pointer)
            target = target[part]
        name = f"g_ref_{len(self.refs)}"
        self.refs[ref] = name
        self.rules[name] = ""  # reserved first: a recursive schema refers to itself
        self.rules[name] = self.value(target, ref[1:])
        return name

    def _enum(self, schema: dict[str, Any], pointer: str) -> str:
        from jsonschema.validators import validator_for

        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        validator = validator_for(rest)(rest)
        kept = [v for v in values if validator.is_valid(v)]
        if not kept:
            raise UnsupportedSchema("'enum'/'const' with no value the rest of the schema allows", pointer)
        literals = []
        for value in kept:
            if not _writable(value):
                raise UnsupportedSchema(f"enum value {value!r} cannot be written in Gemma's notation", pointer)
            literals.append(_literal(notation(value)))
        return self.rule("enum", " | ".join(dict.fromkeys(literals)))

    def _any_of(self, schema: dict[str, Any], pointer: str) -> str:
        siblings = {k: v for k, v in schema.items() if k != "anyOf"}
        branches = []
        for i, branch in enumerate(schema["anyOf"]):
            if siblings and isinstance(branch, dict):
                if set(siblings) & set(branch):
                    raise UnsupportedSchema("the same keyword beside 'anyOf' and inside a branch", pointer)
                branch = {**siblings, **branch}
            elif siblings and branch is True:
                branch = siblings
            branches.append(self.value(branch, f"{pointer}/anyOf/{i}"))
        return self.rule("anyof", " | ".join(branches))

    def _string(self, schema: dict[str, Any], pointer: str) -> str:
        pattern = schema.get("pattern")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if pattern is not None:
            if low or high is not None:
                raise UnsupportedSchema("'pattern' together with 'minLength'/'maxLength'", pointer)
            return self.rule("pattern", f'"<|\\"|>" {self._regex(pattern, pointer)} "<|\\"|>"')
        if not low and high is None:
            return "g_string"
        body = "" if high == 0 else f"g_char{_count(low, high)} "
        return self.rule("str", f'"<|\\"|>" {body}"<|\\"|>"')

    def _regex(self, pattern: str, pointer: str) -> str:
        import xgrammar as xgr

        try:
            ebnf = str(xgr.Grammar.from_regex(pattern))
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on regexes it cannot convert
            raise UnsupportedSchema(f"pattern {pattern!r} cannot be enforced: {exc}", pointer) from None
        return self._embed(ebnf, "re")

    def _number(self, kind: str, schema: dict[str, Any]) -> str:
        bounds = {k: schema[k] for k in _NUMERIC_KEYS if k in schema}
        if not bounds and kind == "number":
            return "g_number"
        return self._embed(_json_schema_ebnf(json.dumps({"type": kind, **bounds})), "num")

    def _embed(self, ebnf: str, stem: str) -> str:
        """Another grammar's rules under fresh names; its root becomes the returned rule."""
        prefix = f"g_{stem}{len(self.rules)}_"
        for line in ebnf.strip().splitlines():
            name, _, body = line.partition(" ::= ")
            self.rules[prefix + name.strip()] = _rename(body, prefix)
        return prefix + "root"

    def _object(self, schema: dict[str, Any], pointer: str) -> str:
        properties = dict(schema.get("properties") or {})
        required = list(schema.get("required") or [])
        extra = schema.get("additionalProperties", True)  # extras only generated where nothing is declared
        for key in required:
            if key not in properties:
                if extra is False:
                    raise UnsupportedSchema(f"required property {key!r} is not allowed", pointer)
                properties[key] = True if extra is True else extra
        for key in properties:
            if not writable_key(key):
                raise UnsupportedSchema(f"property name {key!r} cannot be written bare in Gemma's notation", pointer)
        if not properties:
            if extra is False:
                return '"{" "}"'
            if extra is True or extra == {}:
                return "g_any_object"
            pair = f'g_key ":" {self.value(extra, pointer + "/additionalProperties")}'
            return self.rule("map", f'"{{" "}}" | "{{" {pair} ("," {pair})* "}}"')
        pairs = [
            (f'{_literal(key + ":")} {self.value(sub, f"{pointer}/properties/{key}")}', key in required)
            for key, sub in properties.items()
        ]
        return self.rule("obj", f'"{{" {self._properties(pairs)} "}}"')

    def _properties(self, pairs: list[tuple[str, bool]]) -> str:
        """Properties in order, optional ones skippable, comma-separated: ``first`` = none written
        yet, ``rest`` = after at least one (each then starts with a comma)."""
        first, rest = '""', '""'
        for pair, required in reversed(pairs):
            new_rest = self.rule("more", f'"," {pair} {rest}' + ("" if required else f" | {rest}"))
            new_first = self.rule("props", f"{pair} {rest}" + ("" if required else f" | {first}"))
            first, rest = new_first, new_rest
        return first

    def _array(self, schema: dict[str, Any], pointer: str) -> str:
        """``prefixItems`` in full (cut at ``maxItems``), then ``items`` within the count bounds."""
        prefix = list(schema.get("prefixItems") or [])
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        prefix = prefix[: len(prefix) if high is None else high]
        items = schema.get("items", False if prefix else True)
        more_low = max(0, low - len(prefix))
        more_high = None if high is None else high - len(prefix)
        if items is False:
            if more_low:
                raise UnsupportedSchema("'minItems' beyond 'prefixItems' with no further items allowed", pointer)
            more_high = 0
        elements = [self.value(sub, f"{pointer}/prefixItems/{i}") for i, sub in enumerate(prefix)]
        if more_high == 0:
            return self.rule("tuple", f'"[" {_sep(elements)} "]"')
        item = self.value(items, pointer + "/items")
        if elements:
            return self.rule("tuple", f'"[" {_sep(elements)} ("," {item}){_count(more_low, more_high)} "]"')
        listed = f'"[" {item} ("," {item}){_count(max(0, more_low - 1), None if more_high is None else more_high - 1)} "]"'
        return self.rule("array", listed if more_low else f'"[" "]" | {listed}')


def _sep(elements: list[str]) -> str:
    return ' "," '.join(elements) or '""'


def _count(low: int, high: int | None) -> str:
    return f"{{{low}, {-1 if high is None else high}}}"


def _writable(value: Any) -> bool:
    if isinstance(value, dict):
        return all(writable_key(k) and _writable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_writable(v) for v in value)
    if isinstance(value, str):
        return QUOTE not in value
    return True


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


def _rename(body: str, prefix: str) -> str:
    """Rule references in an EBNF body prefixed (string literals and character classes kept)."""
    return "".join(prefix + t if t[0].isalpha() or t[0] == "_" else t for t in _TOKEN.findall(body))


@DERIVED_TEXT.cached
def _json_schema_ebnf(schema: str) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
