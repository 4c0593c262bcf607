"""``oneOf`` over the host formats, ``{"oneOf": [{"format": "hostname"}, {"format": "ipv4"},
{"format": "ipv6"}]}``, made exact by set algebra on the three languages.

* Every ``ipv4`` dotted quad is a ``hostname`` (RFC 1123 allows all-digit labels; four labels of
  at most three characters are far below 253): ``ipv4 ⊆ hostname``.
* An ``ipv6`` address always holds a ``:``, which neither of the others does: it is disjoint from
  both.

So a string matches exactly one of the three when it is an ``ipv6`` address or a host name that is
not a dotted quad (:data:`HOSTNAME_NOT_IPV4`, a regex of its own: a label count other than four,
or four labels of which one is no ``dec-octet``); no ``ipv4`` address matches ``ipv4`` alone.
Tests prove the three relations and the difference on the DFAs of the patterns.
"""

from __future__ import annotations

from typing import Any

from ..regex.dialect import ecma_regex
from .formats import DEC_OCTET, HOSTNAME_LABEL, HOSTNAME_MAX_LENGTH, LONG_HOSTNAME_LABEL, format_keywords
from .keywords import meaningful
from .tree import resolve

_HOST_FORMATS = ("hostname", "ipv4", "ipv6")
# host labels of 1-3 characters that are no dec-octet: a letter or hyphen in them, a leading
# zero, or three digits past 255
_SHORT_NOT_OCTET = "|".join([
    "[A-Za-z]",
    "[A-Za-z][A-Za-z0-9]", "[0-9][A-Za-z]", "0[0-9]",
    "[A-Za-z][A-Za-z0-9-][A-Za-z0-9]", "[0-9][A-Za-z-][A-Za-z0-9]", "[0-9]{2}[A-Za-z]", "0[0-9]{2}",
    "25[6-9]", "2[6-9][0-9]", "[3-9][0-9]{2}",
])
NOT_OCTET_LABEL = f"(?:{_SHORT_NOT_OCTET}|{LONG_HOSTNAME_LABEL})"


def _hostname_not_ipv4() -> str:
    """Host names (RFC 1123 labels) that are no dotted quad: fewer or more than four labels, or
    four with a first label (counting from the left) that is no dec-octet."""
    label, octet, other = HOSTNAME_LABEL, DEC_OCTET, NOT_OCTET_LABEL
    counts = rf"{label}(?:(?:\.{label}){{1,2}}|(?:\.{label}){{4,}})?"
    four = [rf"(?:{octet}\.){{{k}}}{other}(?:\.{label}){{{3 - k}}}" for k in range(4)]
    return "^(?:" + "|".join([counts, *four]) + ")$"


HOSTNAME_NOT_IPV4 = _hostname_not_ipv4()


def _format_of(branch: Any, root: dict) -> str | None:
    """The host format whose exact keywords (:mod:`.formats`) ``branch`` says, and nothing else
    but ``type: string``; None for any other branch."""
    node = resolve(branch, root)
    if not isinstance(node, dict):
        return None
    said = meaningful(node)
    if said.get("type", "string") != "string":
        return None
    said.pop("type", None)
    return next((name for name in _HOST_FORMATS if said == format_keywords(name)), None)


def _says_string(branch: Any, root: dict) -> bool:
    node = resolve(branch, root)
    return isinstance(node, dict) and node.get("type") == "string"


def _alone(name: str, others: set[str]) -> Any:
    """The strings of format ``name`` that match none of the formats ``others`` (False: none)."""
    if name == "ipv4":
        return False if "hostname" in others else {"type": "string", **format_keywords("ipv4")}
    if name == "hostname" and "ipv4" in others:
        return {"type": "string", "pattern": ecma_regex(HOSTNAME_NOT_IPV4, json_string=True),
                "maxLength": HOSTNAME_MAX_LENGTH}
    return {"type": "string", **format_keywords(name)}  # ipv6 shares nothing with the others


def exclusive_host_formats(branches: list[Any], root: dict) -> Any:
    """"Exactly one of ``branches``" when each is a distinct host format (``hostname``,
    ``ipv4``, ``ipv6``, as :mod:`.formats` writes them), else None. A non-string matches the
    branches without ``type: string``: none, or two or more, so it never matches one alone."""
    names = [_format_of(b, root) for b in branches]
    if None in names or len(set(names)) != len(names) or len(names) < 2:
        return None
    typed = [_says_string(b, root) for b in branches]
    if typed.count(False) == 1:  # a non-string matches that branch alone: not written here
        return None
    options = [o for name in names if (o := _alone(name, set(names) - {name})) is not False]
    if not options:
        return False
    return options[0] if len(options) == 1 else {"anyOf": options}
