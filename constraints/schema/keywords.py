"""The vocabulary of JSON Schema as Trellis reads it: the types, the formats (the patterns that
enforce them are in :mod:`.formats`), the keywords that are annotations, the keywords some draft
defines, the keywords xgrammar enforces."""

from __future__ import annotations

from typing import Any

from .formats import FORMAT_PATTERNS, REFUSED_FORMATS  # FORMAT_PATTERNS: re-exported

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
# formats the JSON Schema drafts define: validators may assert them, so they are never dropped
# (each is enforced by an exact pattern or refused by name: :mod:`.formats`); any other format
# name is a pure annotation (no validator can check it) and is dropped, and so is draft-03's
# "utc-millisec": it gives a number a meaning (milliseconds since 1970) and allows every number
SPEC_FORMATS = frozenset(FORMAT_PATTERNS) | frozenset(REFUSED_FORMATS) | frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
     "idn-email", "idn-hostname", "uri-reference", "iri", "iri-reference", "uri-template",
     "json-pointer", "relative-json-pointer", "regex", "ip-address", "host-name", "color",
     "style", "phone"}
)


FORMAT_ALIASES = {"ip-address": "ipv4", "host-name": "hostname"}  # draft-03 names
# formats draft-03 alone defines: in a schema that names a later draft they are unknown names,
# which assert nothing (draft-04 and later: an unknown format succeeds); draft-03's names of
# ipv4 and hostname among them (read as those where the schema names no draft)
DRAFT3_ONLY_FORMATS = frozenset({"color", "style", "phone"}) | frozenset(FORMAT_ALIASES)
LATER_DRAFTS = ("draft-04", "draft-06", "draft-07", "2019-09", "2020-12")
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


# every keyword some JSON Schema draft gives a meaning (assertions, applicators, identifiers)
SPEC_KEYWORDS = REF_IGNORED_SIBLINGS | ANNOTATIONS | frozenset(
    {"$ref", "$defs", "definitions", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
     "unevaluatedItems", "contentSchema", "$dynamicRef", "$recursiveRef", "$dynamicAnchor",
     "$recursiveAnchor", "$vocabulary", "minContains", "maxContains", "extends", "disallow", "divisibleBy",
     "optional", "requires"}
)


def meaningful(node: dict) -> dict:
    """``node`` without its annotations."""
    return {k: v for k, v in node.items() if k not in ANNOTATIONS}


def type_list(value: Any) -> list[str] | None:
    """The types a ``type`` value names, sorted (``number`` takes in ``integer``), or None when
    it is not one type or a list of them."""
    types = [value] if isinstance(value, str) else value
    if not isinstance(types, list) or not all(t in ALL_TYPES for t in types):
        return None
    out = set(types)
    if "number" in out:
        out.add("integer")
    return sorted(out)
