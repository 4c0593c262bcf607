"""The vocabulary of JSON Schema as Trellis reads it: the types, the formats (and the patterns
that enforce them), the keywords that are annotations, the keywords some draft defines, the
keywords xgrammar enforces."""

from __future__ import annotations

from typing import Any

from ..regex.dialect import class_items

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
