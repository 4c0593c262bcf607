"""``oneOf`` over ``hostname`` / ``ipv4`` / ``ipv6`` (constraints/schema/address_formats.py).

The set algebra is proven on the patterns' DFAs (ipv4 within hostname, ipv6 apart from both,
the hand-written "host name but no dotted quad" equal to the difference), and the compiled
schemas are checked against independent oracles: Python's ``ipaddress`` and a host-name check
written here from RFC 1123 (with Trellis's rule against ``--`` in a label's 3rd and 4th places)."""

from __future__ import annotations

import ipaddress
import random
import re

import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.regex.disjoint import pattern_language
from constraints.schema.address_formats import HOSTNAME_NOT_IPV4, NOT_OCTET_LABEL
from constraints.schema.formats import DEC_OCTET, FORMAT_PATTERNS, HOSTNAME_LABEL

from .conftest import walk_json

HOST_ONE_OF = {"type": "string", "oneOf": [{"format": "hostname"}, {"format": "ipv4"}, {"format": "ipv6"}]}
SAMPLES = ["example.com", "1.2.3.4", "255.255.255.255", "1.2.3.04", "1.2.3", "1.2.3.4.5", "a.2.3.4", "1.2.3.a",
           "256.1.1.1", "::1", "::", "1::2:1.2.3.4", "fe80::a%eth1", "bad host", "", "-a.com", "a" * 63 + ".b",
           "a" * 64 + ".b", "01.2.3.4", "1.2.3.4.", "ab--c.com", "x"]


def _language(pattern: str):
    return pattern_language(pattern, limit=10_000)


def _host(text: str) -> bool:
    """RFC 1123 host names as Trellis writes them (no ``--`` in a label's 3rd and 4th places)."""
    labels = text.split(".")
    return len(text) <= 253 and all(
        1 <= len(label) <= 63 and re.fullmatch(r"[A-Za-z0-9-]+", label) and label[0] != "-" and label[-1] != "-"
        and label[2:4] != "--" for label in labels)


def _address(cls, text: str) -> bool:
    try:
        cls(text)
    except ValueError:
        return False
    return "%" not in text  # a scope id is no part of RFC 4291's text form


def _exactly_one(text: str) -> bool:
    return [_host(text), _address(ipaddress.IPv4Address, text), _address(ipaddress.IPv6Address, text)].count(True) == 1


def test_the_set_algebra_holds_on_the_automata():
    host, v4, v6 = (_language(FORMAT_PATTERNS[name]) for name in ("hostname", "ipv4", "ipv6"))
    assert (v4 - host).empty()  # every dotted quad is a host name
    assert (v6 & host).empty() and (v6 & v4).empty()
    assert ((host - v4) ^ _language(HOSTNAME_NOT_IPV4)).empty()


def test_labels_that_are_no_octet_exactly():
    chars = "aZ09-5"
    words = [a + b + c for a in chars for b in chars + "" for c in chars] + list(chars) + [a + b for a in chars for b in chars]
    words += [str(n) for n in range(1000)] + [f"{n:02d}" for n in range(100)] + [f"{n:03d}" for n in range(1000)]
    for word in words:
        expected = bool(re.fullmatch(HOSTNAME_LABEL, word)) and not re.fullmatch(DEC_OCTET, word)
        assert bool(re.fullmatch(NOT_OCTET_LABEL, word)) == expected, word


def _random_address_like(rng: random.Random) -> str:
    parts = [rng.choice(["0", "1", "25", "255", "256", "01", "a", "ff", "-", "ab-c", "xn--a", "9" * rng.randint(1, 4)])
             for _ in range(rng.randint(1, 6))]
    return rng.choice([".", ".", ":", "::"]).join(parts)


def test_the_compiled_one_of_is_exact(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", HOST_ONE_OF))
    rng = random.Random(5)
    texts = SAMPLES + [_random_address_like(rng) for _ in range(300)]
    assert [t for t in texts if walk_json(compiled, tok, t) != _exactly_one(t)] == []
    assert not walk_json(compiled, tok, 5)


def test_untyped_branches_take_no_non_string(compiler, tok):
    schema = {"oneOf": [{"format": "hostname"}, {"format": "ipv4"}]}
    compiled = compiler.compile(ConstraintSpec("json_schema", schema))
    assert walk_json(compiled, tok, "example.com") and walk_json(compiled, tok, "1.2.3.a")
    assert not walk_json(compiled, tok, "1.2.3.4") and not walk_json(compiled, tok, 7)
    assert not walk_json(compiled, tok, None)


@pytest.mark.parametrize("branches", [
    [{"format": "hostname"}, {"format": "hostname"}],  # twice: no string matches one alone
    [{"type": "string", "format": "hostname"}, {"format": "ipv4"}],  # a number matches ipv4 alone
])
def test_other_shapes_stay_refused(compiler, branches):
    with pytest.raises(UnsupportedConstraintError, match="oneOf"):
        compiler.compile(ConstraintSpec("json_schema", {"oneOf": branches}))


def test_draft_3_host_name_asserts_nothing_in_later_drafts(compiler, tok):
    later = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "format": "host-name"}
    compiled = compiler.compile(ConstraintSpec("json_schema", later))
    assert walk_json(compiled, tok, "not a host")
    draft3 = compiler.compile(ConstraintSpec("json_schema", {**later, "$schema": "http://json-schema.org/draft-03/schema#"}))
    assert walk_json(draft3, tok, "example.com") and not walk_json(draft3, tok, "not a host")
    hosts = {**HOST_ONE_OF, "$schema": "http://json-schema.org/draft-03/schema#",
             "oneOf": [{"format": "host-name"}, {"format": "ip-address"}, {"format": "ipv6"}]}
    compiled = compiler.compile(ConstraintSpec("json_schema", hosts))
    assert walk_json(compiled, tok, "::1") and not walk_json(compiled, tok, "1.2.3.4")
