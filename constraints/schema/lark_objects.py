"""Objects written as Lark rules, for the Lark emitter (:mod:`constraints.schema.lark`) where a
``contains`` lies below one of an object's properties (llguidance cannot embed a Lark rule
inside a ``%json`` schema, so such an object is spelled out in the grammar itself).

The object's language is exactly that of ``properties``, ``required`` and
``additionalProperties`` (false, true or a schema) over every part of a conjunction, with the
keys in the declared ``properties`` order (as llguidance writes JSON objects): the listed keys
first, each at most once, then any number of unlisted keys, whose names exclude the listed ones
in every JSON spelling of them (``"\\u0061"`` is ``"a"``). A listed key may be spelled any way
JSON allows. Each value is the rule of the conjunction of the schemas that apply to its key.
Other keywords that constrain objects are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UnsupportedConstraintError
from .keywords import meaningful

# keywords that constrain objects (the ones handled here and the refused ones)
OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                         "minProperties", "maxProperties", "dependencies", "dependentRequired",
                         "dependentSchemas", "unevaluatedProperties"})
_HANDLED = frozenset({"properties", "required", "additionalProperties"})
# keywords beside the object's own that would also constrain it
_REFUSED_BESIDE = ("not", "oneOf", "if", "then", "else", "$dynamicRef", "$recursiveRef", "extends", "disallow")
MAX_PROPERTIES = 400  # listed keys of one object written as rules

# one JSON string, in any spelling JSON allows
JSON_STRING = r'"(?:[^"\\\x00-\x1F]|\\(?:["\\\x{2F}bfnrt]|u[0-9a-fA-F]{4}))*"'
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}


def refuse(keyword: str, why: str) -> UnsupportedConstraintError:
    """The refusal of ``keyword``, which has no exact form in the grammar."""
    return UnsupportedConstraintError(f"keyword {keyword!r} is not supported for enforcement: {why}",
                                      keyword=keyword)


@dataclass(frozen=True)
class ObjectLayout:
    """The Lark spelling of an object's punctuation in the request's layout."""

    open: str
    close: str
    sep: str
    colon: str


@dataclass(frozen=True)
class _Field:
    name: str
    schemas: list[Any]  # all apply to its value
    required: bool


def object_body(parts: list[dict], layout: ObjectLayout, value_rule: Callable[[list[Any]], str | None],
                add_rule: Callable[[str], str], add_terminal: Callable[[str], str]) -> str | None:
    """The rule body of the objects that satisfy every part (None: no object does).
    ``value_rule(schemas)`` names the rule of the values satisfying all ``schemas`` (None: none
    does), ``add_rule`` / ``add_terminal`` name a rule / terminal body.

    Raises UnsupportedConstraintError naming a keyword that has no exact form here."""
    parts = [_without_trivial_patterns(p) for p in parts]
    _check(parts)
    fields = _fields(parts)
    if len(fields) > MAX_PROPERTIES:
        raise refuse("properties", f"an object written as a grammar may list at most {MAX_PROPERTIES} properties")
    extra = [p["additionalProperties"] for p in parts if "additionalProperties" in p]
    pair = _extra_pair(fields, extra, layout, value_rule, add_terminal)
    none = layout.close if pair is None else add_rule(f"{layout.close} | {pair} {add_rule(_more(pair, layout))}")
    some = layout.close if pair is None else add_rule(_more(pair, layout))
    # from the last key back: ``none`` follows when no key came yet, ``some`` after one
    for index in range(len(fields) - 1, -1, -1):
        field = fields[index]
        value = value_rule(field.schemas)
        if value is None:
            if field.required:
                return None
            continue
        entry = f"/{_spellings(field.name)}/ {layout.colon} {value} {some}"
        none_options, some_options = [entry], [f"{layout.sep} {entry}"]
        if not field.required:
            none_options.append(none)
            some_options.append(some)
        none = add_rule(" | ".join(none_options))
        some = add_rule(" | ".join(some_options)) if index else some
    return f"{layout.open} {none}"


def _without_trivial_patterns(part: dict) -> dict:
    """``part`` without its patternProperties where they change nothing: every pattern's
    schema allows any value and so do the part's additionalProperties."""
    patterns = part.get("patternProperties")
    if not isinstance(patterns, dict) or not all(_trivial(s) for s in patterns.values()):
        return part
    if not _trivial(part.get("additionalProperties", True)):
        return part
    return {k: v for k, v in part.items() if k != "patternProperties"}


def _trivial(schema: Any) -> bool:
    return schema is True or isinstance(schema, dict) and not meaningful(schema)


def _check(parts: list[dict]) -> None:
    for part in parts:
        for key in [*sorted(OBJECT_KEYS - _HANDLED), *_REFUSED_BESIDE]:
            if key in part:
                raise refuse(key, "it is not enforced on an object written as a grammar (one holding a contains)")
        required = part.get("required", [])
        if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
            raise refuse("required", "beside a contains it must be a list of property names")
        properties = part.get("properties", {})
        if not isinstance(properties, dict):
            raise refuse("properties", "its value is not an object")
        for sub in properties.values():
            if isinstance(sub, dict) and ("optional" in sub or isinstance(sub.get("required"), bool)):
                raise refuse("required", "draft-03 required / optional flags are not enforced beside a contains")


def _fields(parts: list[dict]) -> list[_Field]:
    """The listed keys in declared order (then required keys no part lists), each with the
    schemas of its value: a part's property schema, else that part's additionalProperties."""
    names: dict[str, None] = {}
    for part in parts:
        names.update(dict.fromkeys(part.get("properties", {})))
    required = {n for part in parts for n in part.get("required", [])}
    for part in parts:
        names.update(dict.fromkeys(part.get("required", [])))
    fields = []
    for name in names:
        schemas = [p["properties"][name] if name in p.get("properties", {}) else p["additionalProperties"]
                   for p in parts if name in p.get("properties", {}) or "additionalProperties" in p]
        fields.append(_Field(name, schemas, name in required))
    return fields


def _extra_pair(fields: list[_Field], extra: list[Any], layout: ObjectLayout,
                value_rule: Callable[[list[Any]], str | None], add_terminal: Callable[[str], str]) -> str | None:
    """``KEY colon value`` for an unlisted key (None: no unlisted key is allowed)."""
    value = value_rule(extra)
    if value is None:
        return None
    key = f"/{JSON_STRING}/"
    if fields:
        key += " & ~(" + " | ".join(f"/{_spellings(f.name)}/" for f in fields) + ")"
    return f"{add_terminal(key)} {layout.colon} {value}"


def _more(pair: str, layout: ObjectLayout) -> str:
    return f"({layout.sep} {pair})* {layout.close}"


def _spellings(name: str) -> str:
    """A regex of every JSON string literal whose value is ``name``."""
    return '"' + "".join(f"(?:{'|'.join(_char_spellings(c))})" for c in name) + '"'


def _char_spellings(char: str) -> list[str]:
    code = ord(char)
    out = []
    if code >= 0x20 and char not in '"\\' and not 0xD800 <= code <= 0xDFFF:
        out.append(_literal(char))
    if char in _SHORT_ESCAPES:
        out.append(r"\\" + _literal(_SHORT_ESCAPES[char]))
    units = [code] if code < 0x10000 else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
    out.append("".join(r"\\u" + "".join(_hex_digit(d) for d in f"{unit:04x}") for unit in units))
    return out


def _literal(char: str) -> str:
    return f"\\x{{{ord(char):X}}}"


def _hex_digit(digit: str) -> str:
    return digit if digit.isdigit() else f"[{digit}{digit.upper()}]"
