"""``format`` is enforced by an exact pattern (constraints/schema/formats.py) or refused by name.

Each pattern is checked against an independent oracle where one exists (the calendar for
dates, UTC arithmetic for leap seconds, Python's ``ipaddress``), and each format is compiled
and walked token by token: valid instances go through, invalid ones do not."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re

import pytest

from constraints import ConstraintSpec, UnsupportedConstraintError
from constraints.schema.formats import (
    FORMAT_PATTERNS,
    HOSTNAME_MAX_LENGTH,
    format_keywords,
)

from .conftest import walk_json, walk_text

VALID = {
    "date-time": ["1963-06-19T08:30:06.283185Z", "1998-12-31T23:59:60Z", "1998-12-31T15:59:60.123-08:00",
                  "2020-02-29t00:00:00z", "1937-01-01T12:00:27.87+00:20"],
    "date": ["2020-02-29", "0400-02-29", "1999-12-31", "0001-01-01"],
    "time": ["08:30:06Z", "23:59:60Z", "01:29:60+01:30", "00:29:60-23:30", "12:34:56-00:00", "08:30:06z"],
    "duration": ["P4DT12H30M5S", "P2W", "PT36H", "P1Y2M", "PT1M2S", "P0D", "P01D"],
    "hostname": ["www.example.com", "1host", "a--b.com", "a" * 63 + ".com", ".".join(["a" * 63] * 3 + ["a" * 61])],
    "email": ["joe.bloggs@example.com", '"joe bloggs"@example.com', '"a\\"b"@x.org', "te~st@example.com",
              "joe@[127.0.0.1]", "joe@[IPv6:::1]", "a@[IPv6:1:2:3:4:5:6:1.2.3.4]"],
    "ipv4": ["0.0.0.0", "255.255.255.255", "192.168.0.1"],
    "ipv6": ["::1", "::", "1:d6::42", "1::d6:192.168.0.1", "::ffff:192.168.0.1", "1:2:3:4:5:6:7:8",
             "1:2::3:4:5:6:7", "1000:1000:1000:1000:1000:1000:255.255.255.255"],
    "uuid": ["2EB8AA08-AA98-11EA-B4AA-73B441D16380", "00000000-0000-0000-0000-000000000000"],
    "uri": ["http://[V1.fe]", "urn:example:resource", "http://[::ffff:192.168.0.1]/p"],
    "iri": ["http://ƒøø.ßår/?∂éœ=πîx#πîüx", "http://[2001:db8::1]"],
    "uri-template": ["a'b", "{+var}", "http://example.com/{term:1}/{term}"],
    "json-pointer": ["", "/foo/0", "/a~1b", "/m~0n"],
}
INVALID = {
    "date-time": ["1998-12-31T23:59:61Z", "1998-12-31T23:58:60Z", "1998-12-31T22:59:60Z", "1990-02-31T15:59:59Z",
                  "1990-12-31T15:59:59-24:00", "1985-04-12T23:20:50+01", "1963-06-19 08:30:06Z", "2016-12-31T24:59:60+01:00"],
    "date": ["2021-02-29", "2100-02-29", "0100-02-29", "2020-04-31", "2020-13-01", "2020-00-10", "2020-01-00",
             "1998-1-20", "20230328", "2020-01-01Z"],
    "time": ["22:59:60Z", "23:59:60+01:00", "23:59:60-00:30", "24:00:00Z", "12:00:00", "01:02:03+00:60",
             "08:30:06 PST", "01:01:01,1111"],
    "duration": ["PT1D", "P", "PT", "P1YT", "P2D1Y", "P1D2H", "P1Y2W", "PT1H2S", "P1Y2D", "PT0.5S", "-P1D"],
    "hostname": ["", ".", "example.", "-a.com", "a-.com", "host_name", "a" * 64 + ".com", "ab--c.com",
                 "xn--9n2bp8q", "XN--aa---o47jg78q", ".".join(["a" * 63] * 4)],
    "email": ["2962", ".test@example.com", "te..st@example.com", "joe.bloggs@invalid=domain.com",
              "joe@[127.0.0.300]", "@example.com", "joe@", "joe bloggs@example.com", "a@[IPv6:1::2::3]",
              "a@[IPv6:1:2:3:4:5:6:7::1.2.3.4]"],
    "ipv4": ["127.0.0.0.1", "256.256.256.256", "127.1", "087.10.0.1", "192.168.0.1/24", "0x7f.0.0.1"],
    "ipv6": ["12345::", "1::d6::42", "1:2:3:4:5:6:7", "1::2:192.168.256.1", "::ffff:192.168.0.01", "[::1]",
             "fe80::a%eth1", "1:2:3:4:5:6:7:8:9"],
    "uuid": ["2eb8aa08-aa98-11ea-b4aa-73b441d1638", "2eb8aa08aa9811eab4aa73b441d16380"],
    "uri": ["//example.org/a", "http://[::ffff:192.168.0.01]", "a b:c"],
    "iri": ["/abc", "âππ"],
    "uri-template": ["{}", "{v:0}", "a b", "foo}bar"],
    "json-pointer": ["a", "/~2", "#/a"],
}


def _matches(fmt: str, text: str) -> bool:
    keywords = format_keywords(fmt)
    return re.fullmatch(FORMAT_PATTERNS[fmt], text) is not None and len(text) <= keywords.get("maxLength", len(text))


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_pattern_classifies_each_case(fmt):
    assert [v for v in VALID[fmt] if not _matches(fmt, v)] == []
    assert [v for v in INVALID[fmt] if _matches(fmt, v)] == []


def test_dates_follow_the_calendar():
    """Every month-day of leap, common and century years against ``datetime.date``."""
    for year in (1, 400, 1900, 2000, 2023, 2024, 2100, 9999):
        for month in range(14):
            for day in range(33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date(year, month, day)
                    real = True
                except ValueError:
                    real = False
                assert _matches("date", text) is real, text


def test_a_leap_second_is_23_59_60_utc():
    """``HH:MM:60`` with an offset is valid exactly when it is 23:59:60 UTC (every local minute,
    every offset minute of a random sample of hours)."""
    rng = random.Random(3)
    for hour in range(24):
        for minute in range(60):
            for sign in "+-":
                for off_h, off_m in [(rng.randrange(24), rng.randrange(60)) for _ in range(3)]:
                    offset = (off_h * 60 + off_m) * (1 if sign == "+" else -1)
                    utc = (hour * 60 + minute - offset) % 1440
                    text = f"{hour:02d}:{minute:02d}:60{sign}{off_h:02d}:{off_m:02d}"
                    assert _matches("time", text) is (utc == 1439), text
                    inverse = (hour * 60 + minute - 1439) % 1440  # the one offset ahead that fits
                    exact = f"{hour:02d}:{minute:02d}:60.5+{inverse // 60:02d}:{inverse % 60:02d}"
                    assert _matches("time", exact), exact


def test_ip_addresses_agree_with_ipaddress():
    """Random addresses in every text form (compressed, exploded, embedded IPv4) and one-character
    mutations of them, against Python's ``ipaddress``."""
    rng = random.Random(5)
    texts = []
    for _ in range(400):
        groups = [rng.choice([0, 0, rng.getrandbits(16), rng.getrandbits(4)]) for _ in range(8)]
        v6 = ipaddress.IPv6Address(sum(g << (16 * i) for i, g in enumerate(groups)))
        v4 = ipaddress.IPv4Address(rng.getrandbits(32))
        forms = [v6.compressed, v6.exploded, f"{v6.compressed.rsplit(':', 2)[0]}:{v4}", str(v4)]
        for form in forms:
            texts.append(form)
            at = rng.randrange(len(form))
            texts.append(form[:at] + rng.choice("0:.f") + form[at + 1:])
            texts.append(form[:at] + form[at + 1:])
    for text in texts:
        for fmt, cls in (("ipv6", ipaddress.IPv6Address), ("ipv4", ipaddress.IPv4Address)):
            try:
                cls(text)
                real = "%" not in text
            except ValueError:
                real = False
            assert _matches(fmt, text) is real, (fmt, text)


def test_hostname_length_is_a_max_length():
    assert format_keywords("hostname")["maxLength"] == HOSTNAME_MAX_LENGTH == 253


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_format_is_enforced_token_by_token(compiler, tok, fmt):
    compiled = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "format": fmt}))

    def walk(value: str) -> bool:  # non-ASCII written as itself, as Trellis generates it
        return walk_text(compiled, tok, json.dumps(value, ensure_ascii=False))

    assert [v for v in VALID[fmt] if not walk(v)] == []
    assert [v for v in INVALID[fmt] if walk(v)] == []


def test_format_applies_only_to_strings_and_beside_a_pattern(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", {"format": "date", "pattern": "^2020"}))
    assert walk_json(compiled, tok, "2020-02-29") and walk_json(compiled, tok, 7)
    assert not walk_json(compiled, tok, "2021-01-01") and not walk_json(compiled, tok, "2020-02-30")


@pytest.mark.parametrize("fmt", ["idn-hostname", "idn-email"])
def test_formats_without_an_exact_form_are_refused_by_name(compiler, fmt):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": fmt}}}
    with pytest.raises(UnsupportedConstraintError) as info:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert f"format {fmt!r} at /properties/a" in info.value.message
    assert info.value.keyword == "format" and info.value.pointer == "/properties/a"


@pytest.mark.parametrize("fmt", ["color", "style", "phone"])
def test_draft_3_formats_are_names_in_later_drafts(compiler, tok, fmt):
    # MaskBench Github_ultra o19343 (draft-04, "format": "color"): draft-04 defines no such
    # format, so it asserts nothing; draft 3 defines it, and it stays refused there
    later = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "format": fmt}
    compiled = compiler.compile(ConstraintSpec("json_schema", later))
    assert walk_json(compiled, tok, "not a color, style or phone") and not walk_json(compiled, tok, 3)
    with pytest.raises(UnsupportedConstraintError, match=f"format {fmt!r}"):
        compiler.compile(ConstraintSpec("json_schema", {**later, "$schema": "http://json-schema.org/draft-03/schema#"}))
