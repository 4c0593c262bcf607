"""JSON Schema ``format`` values as exact regexes, or the reason one cannot be enforced.

Every format a JSON Schema draft defines either becomes a ``pattern`` (plus, for ``hostname``, a
``maxLength``) that means exactly what its RFC's ABNF means, or is refused by name under strict
mode. The patterns are written once here, in the dialect every backend reads alike (explicit
ASCII classes, code points as ``\\uXXXX``), and go through the regex front end's ECMA-262
translation (:func:`constraints.regex.dialect.ecma_regex`) like any client ``pattern``.

* ``date``, ``time``, ``date-time`` (RFC 3339 section 5.6): months of 28-31 days, February 29
  only in leap years (every 4th year, not the centuries but every 4th), ``T`` / ``Z``
  either case, and a leap second ``:60`` only at 23:59 UTC, i.e. at the local time that
  its offset puts there (``15:59:60-08:00``).
* ``duration`` (RFC 3339 appendix A, ISO 8601's designators in upper case).
* ``hostname`` (RFC 1123 section 2.1 with RFC 1034's lengths): dot-separated labels of letters,
  digits and inner hyphens, 1 to 63 characters each, at most 253 in all. Labels with ``--`` in
  their 3rd and 4th positions are reserved (RFC 5890 section 2.3.1): the only ones in use are
  IDNA A-labels (``xn--``), whose validity depends on decoding their Punycode, which no regex
  does, so none of them is generated.
* ``email`` (RFC 5321 section 4.1.2 ``Mailbox``): a dot-string or quoted-string local part; a
  domain, or an IPv4 or ``IPv6:`` address literal (no other address-literal tag is registered).
* ``ipv4`` (RFC 2673 dotted-quad), ``ipv6`` (RFC 4291 section 2.2), ``uuid`` (RFC 4122),
  ``uri`` / ``uri-reference`` (RFC 3986), ``iri`` / ``iri-reference`` (RFC 3987),
  ``uri-template`` (RFC 6570), ``json-pointer`` (RFC 6901), ``relative-json-pointer``.

* ``regex`` (ECMA-262): a narrowing, exact from inside (:mod:`.regex_format`): regexes with
  groups nested at most 4 deep, every one of which ECMA-262 and Python's ``re`` compile.

Refused (:data:`REFUSED_FORMATS`): ``idn-hostname`` and ``idn-email`` (IDNA 2008's
per-code-point and contextual rules).
"""

from __future__ import annotations

from functools import lru_cache

from ..regex.dialect import class_items, ecma_regex
from .regex_format import regex_format_pattern

_UCSCHAR = [(0xA0, 0xD7FF), (0xF900, 0xFDCF), (0xFDF0, 0xFFEF)] + [
    (plane, plane + 0xFFFD) for plane in range(0x10000, 0xE0000, 0x10000)] + [(0xE1000, 0xEFFFD)]
_IPRIVATE = [(0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD)]
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
HOSTNAME_MAX_LENGTH = 253


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


def _any(alternatives: list[str]) -> str:
    return "(?:" + "|".join(alternatives) + ")"


# -- addresses --------------------------------------------------------------------------------

DEC_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = rf"{DEC_OCTET}(?:\.{DEC_OCTET}){{3}}"
_H16 = "[0-9A-Fa-f]{1,4}"


def _ipv6() -> str:
    """RFC 3986's ``IPv6address`` (RFC 4291's text forms): eight groups, or fewer around one
    ``::``; the last two groups may be an IPv4 address."""
    ls32 = f"(?:{_H16}:{_H16}|{IPV4})"

    def left(most: int) -> str:  # [ *(most-1)( h16 ":" ) h16 ]
        return "" if most == 0 else f"(?:(?:{_H16}:){{0,{most - 1}}}{_H16})?"

    forms = [f"(?:{_H16}:){{6}}{ls32}", f"::(?:{_H16}:){{5}}{ls32}"]
    forms += [f"{left(n + 1)}::(?:{_H16}:){{{4 - n}}}{ls32}" for n in range(4)]
    forms += [f"{left(5)}::{ls32}", f"{left(6)}::{_H16}", f"{left(7)}::"]
    return _any(forms)


IPV6 = _ipv6()


# -- URIs ---------------------------------------------------------------------------------------


def _uri_pattern(iri: bool, reference: bool) -> str:
    """RFC 3986's ``URI`` / ``URI-reference`` or RFC 3987's ``IRI`` / ``IRI-reference``
    (``iri``: ``ucschar`` is unreserved, ``iprivate`` allowed in the query) as a regex.
    An IPv4 address is one spelling of a reg-name, so ``host`` is an IP literal or a reg-name."""
    unreserved, sub_delims = _ALNUM + "-._~", "!$&'()*+,;="
    wide = _UCSCHAR if iri else []
    pct = "%[0-9A-Fa-f]{2}"

    def chars(extra: str, more: list[tuple[int, int]] = ()) -> str:
        return f"(?:{_char_class(unreserved + sub_delims + extra, wide + list(more))}|{pct})"

    pchar = chars(":@")
    segment, segment_nz = f"{pchar}*", f"{pchar}+"
    segment_nz_nc = f"{chars('@')}+"
    query = f"{chars(':@/?', _IPRIVATE if iri else [])}*"
    fragment = f"{chars(':@/?')}*"
    ipvfuture = rf"[vV][0-9A-Fa-f]+\.{_char_class(unreserved + sub_delims + ':')}+"
    host = rf"(?:\[(?:{IPV6}|{ipvfuture})\]|{chars('')}*)"
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
    space and ``"%<>\\^`{|}``, non-ASCII only from ``ucschar``/``iprivate``, or a
    percent-encoding; the apostrophe as errata 6937 and the test suite allow it) and
    ``{op varspec,...}`` expressions (names of ``[A-Za-z0-9_]`` or percent-encodings,
    dot-separated; a ``:1-9999`` prefix or ``*`` explode modifier)."""
    pct = "%[0-9A-Fa-f]{2}"
    ascii_literals = [(0x21, 0x21), (0x23, 0x24), (0x26, 0x3B), (0x3D, 0x3D), (0x3F, 0x5B),
                      (0x5D, 0x5D), (0x5F, 0x5F), (0x61, 0x7A), (0x7E, 0x7E)]
    literal = f"{_char_class('', ascii_literals + _UCSCHAR + _IPRIVATE)}|{pct}"
    varchar = rf"(?:[A-Za-z0-9_]|{pct})"
    varspec = rf"{varchar}(?:\.?{varchar})*(?::[1-9][0-9]{{0,3}}|\*)?"
    expression = rf"\{{[+#./;?&=,!@|]?{varspec}(?:,{varspec})*\}}"
    return rf"^(?:{literal}|{expression})*$"


# -- dates and times (RFC 3339 section 5.6) ---------------------------------------------------

_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
FULL_DATE = _any([
    "[0-9]{4}-" + _any(["(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])",
                        "(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)",
                        "02-(?:0[1-9]|1[0-9]|2[0-8])"]),
    f"{_LEAP_YEAR}-02-29",
])
_HOUR, _MINUTE = "(?:[01][0-9]|2[0-3])", "[0-5][0-9]"
_SECFRAC = r"(?:\.[0-9]+)?"
_NUMOFFSET = f"[+-]{_HOUR}:{_MINUTE}"


def _leap_second_times() -> str:
    """``HH:MM:60[.frac]offset`` for every local time and offset that put the leap second at
    23:59:60 UTC: each local minute has one positive and one negative offset doing so (and
    23:59 also ``Z``)."""
    by_hour = []
    for hour in range(24):
        minutes = []
        for minute in range(60):
            local = hour * 60 + minute
            ahead, behind = (local - 1439) % 1440, (1439 - local) % 1440
            offsets = [f"\\+{ahead // 60:02d}:{ahead % 60:02d}", f"-{behind // 60:02d}:{behind % 60:02d}"]
            if local == 1439:
                offsets.append("[Zz]")
            minutes.append(f"{minute:02d}:60{_SECFRAC}{_any(offsets)}")
        by_hour.append(f"{hour:02d}:{_any(minutes)}")
    return _any(by_hour)


FULL_TIME = _any([f"{_HOUR}:{_MINUTE}:[0-5][0-9]{_SECFRAC}(?:[Zz]|{_NUMOFFSET})", _leap_second_times()])


def _duration() -> str:
    """RFC 3339 appendix A's ``duration``."""
    n = "[0-9]+"
    second = f"{n}S"
    minute = f"{n}M(?:{second})?"
    hour = f"{n}H(?:{minute})?"
    time = f"T(?:{hour}|{minute}|{second})"
    date = f"(?:{n}D|{n}M(?:{n}D)?|{n}Y(?:{n}M(?:{n}D)?)?)(?:{time})?"
    return f"P(?:{date}|{time}|{n}W)"


# -- host names and mail boxes -----------------------------------------------------------------

_LD, _LDH = "[A-Za-z0-9]", "[A-Za-z0-9-]"
# 1-3, 4, and 5-63 characters; never a hyphen first or last, nor "--" 3rd and 4th (RFC 5890 R-LDH)
LONG_HOSTNAME_LABEL = _any([f"{_LD}{_LDH}{{2}}{_LD}", f"{_LD}{_LDH}(?:{_LD}{_LDH}|-{_LD}){_LDH}{{0,58}}{_LD}"])
HOSTNAME_LABEL = _any([f"{_LD}(?:{_LDH}?{_LD})?", LONG_HOSTNAME_LABEL])
HOSTNAME = rf"{HOSTNAME_LABEL}(?:\.{HOSTNAME_LABEL})*"


def _email() -> str:
    """RFC 5321's ``Mailbox``."""
    atext = _char_class(_ALNUM + "!#$%&'*+-/=?^_`{|}~")
    dot_string = rf"{atext}+(?:\.{atext}+)*"
    quoted = r'"(?:[\u0020\u0021\u0023-\u005b\u005d-\u007e]|\\[\u0020-\u007e])*"'
    sub_domain = f"{_LD}(?:{_LDH}*{_LD})?"
    domain = rf"{sub_domain}(?:\.{sub_domain})*"
    snum = "(?:25[0-5]|2[0-4][0-9]|[01]?[0-9]?[0-9])"
    ipv4 = rf"{snum}(?:\.{snum}){{3}}"
    hexes = "[0-9A-Fa-f]{1,4}"

    def groups(most: int, after: str = "") -> str:  # at most ``most`` colon-separated groups
        return f"(?:{hexes}(?::{hexes}){{0,{most - 1}}}{after})?" if most else ""

    # at most 6 groups beside the "::", at most 4 beside it and an IPv4 address
    comp = [f"{groups(a)}::{groups(6 - a)}" for a in range(7)]
    v4comp = [f"{groups(a)}::{groups(4 - a, ':')}{ipv4}" for a in range(5)]
    ipv6 = _any([f"{hexes}(?::{hexes}){{7}}", *comp, f"{hexes}(?::{hexes}){{5}}:{ipv4}", *v4comp])
    literal = rf"\[(?:{ipv4}|[Ii][Pp][Vv]6:{ipv6})\]"
    return f"(?:{dot_string}|{quoted})@(?:{domain}|{literal})"


_FORMATS = {
    "date": FULL_DATE,
    "time": FULL_TIME,
    "date-time": f"{FULL_DATE}[Tt]{FULL_TIME}",
    "duration": _duration(),
    "hostname": HOSTNAME,
    "email": _email(),
    "ipv4": IPV4,
    "ipv6": IPV6,
    "uuid": "[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}",
    "json-pointer": "(?:/(?:[^~/]|~[01])*)*",
    "relative-json-pointer": "(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)",
}
# formats as whole-string regexes (Python's re reads them as the backends do)
FORMAT_PATTERNS = {name: f"^{body}$" for name, body in _FORMATS.items()} | {
    "uri": _uri_pattern(iri=False, reference=False),
    "uri-reference": _uri_pattern(iri=False, reference=True),
    "iri": _uri_pattern(iri=True, reference=False),
    "iri-reference": _uri_pattern(iri=True, reference=True),
    "uri-template": _uri_template_pattern(),
    "regex": regex_format_pattern(),
}
FORMAT_LENGTHS = {"hostname": HOSTNAME_MAX_LENGTH}  # a maxLength beside the pattern
REFUSED_FORMATS = {
    "idn-hostname": "IDNA 2008 labels depend on per-code-point and contextual Unicode rules that no"
                    " exact pattern captures (a hostname in A-label form fits format 'hostname')",
    "idn-email": "its domain is an IDNA 2008 hostname, whose per-code-point and contextual Unicode"
                 " rules no exact pattern captures",
}


@lru_cache(maxsize=256)  # keyed by a client's format name: bounded
def format_keywords(name: str) -> dict[str, object] | None:
    """The ``pattern`` (and ``maxLength``) that enforce format ``name`` exactly, read as
    ECMA-262 for a JSON string; None when the format has none."""
    pattern = FORMAT_PATTERNS.get(name)
    if pattern is None:
        return None
    out: dict[str, object] = {"pattern": ecma_regex(pattern, json_string=True)}
    if name in FORMAT_LENGTHS:
        out["maxLength"] = FORMAT_LENGTHS[name]
    return out
