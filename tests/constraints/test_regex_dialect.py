"""The regex front end: ECMA-262 shorthand classes made explicit, the same for every backend."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from constraints.regex.dialect import DOT, ecma_lark, ecma_regex

ASCII_DIGIT_CLASS = "[0-9]"


@pytest.mark.parametrize("regex, expected", [
    (r"\d{3}-\d{3}-\d{4}", "[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    (r"[\d.]+", "[0-9.]+"),
    (r"\w+", "[0-9A-Z_a-z]+"),
    (r"\W", "[^0-9A-Z_a-z]"),
    (r"\D", "[^0-9]"),
    (r"[^\d]", "[^0-9]"),
    (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
    (r"\\\d", r"\\[0-9]"),
    (r"\p{L}+\d", r"\p{L}+[0-9]"),  # explicit Unicode stays Unicode
    (r"\P{Nd}", r"\P{Nd}"),
    (r"\pL", r"\pL"),
    (r"a{2,3}", "a{2,3}"),
    (r"\u00e9\x41\u{1F600}", r"\u00e9\x41\u{1F600}"),
    (r"[\]\d]", r"[\]0-9]"),
    (r"[]\d]", r"[]0-9]"),
    (r"[[:alpha:]\d]", r"[\[:alpha:][0-9]]"),  # ECMA: no POSIX classes ("[" is a literal)
    (r"[\b]", r"[\u0008]"),
    (r"(?s)a.b", r"(?s)a.b"),
    (r"(?#a.b)c", r"(?#a.b)c"),
    ("a.b", f"a{DOT}b"),
    (r"\.", r"\."),
    ("[.]", "[.]"),
    (r"(\d)\1", r"([0-9])\1"),
])
def test_translation(regex, expected):
    assert ecma_regex(regex) == expected


def test_no_shorthand_is_unchanged():
    for regex in [r"[a-z]+@[a-z]+\.com", r"(true|false)", r"^\(\)$", r"[^~/]*", "x"]:
        assert ecma_regex(regex) == regex


def test_dotall():
    assert ecma_regex("a.b", dotall=True) == "a.b"


@pytest.mark.parametrize("regex, expected", [
    ('^[^"]*$', r'^[^"\u0000]*$'),
    (r"[^,\\]", r"[^,\\\u0000]"),
    (r'[^\d"]', r'[^0-9"\u0000]'),
    ('[^"-]', r'[^"\u0000-]'),  # before a trailing "-", which would start a range
    (r'[^]"]', r'[^]"\u0000]'),
    ('[^a]', '[^a]'),  # admits both " and \ : quoted exactly
    ('[^"\n]', '[^"\n]'),  # short of the control range already
    ('.', DOT),
    (r'[^\p{L}"]', r'[^\p{L}"]'),  # sets re cannot read are left alone
    ('[^[a]"]', r'[^\[a]"]'),  # ECMA: the class is [^[a], then a literal "]
])
def test_json_string_negations_leave_out_nul(regex, expected):
    """In a schema ``pattern``, a negated class that allows every control character but not
    both of ``"`` and ``\\`` also excludes U+0000 (llguidance quoted it loosely)."""
    assert ecma_regex(regex, json_string=True) == expected
    assert ecma_regex(regex) == ecma_regex(regex.replace("\\u0000", ""))


def test_unterminated_input_is_left_for_the_backend():
    assert ecma_regex("[\\d") == "[0-9"
    assert ecma_regex("\\") == "\\"
    assert ecma_regex("\\u12") == "\\u12"


def test_lark_regex_terminals():
    grammar = 'start: A B "\\\\d." // a comment with /\\d/\nA: /\\d+\\/./\nB: /./s\n'
    out = ecma_lark(grammar)
    assert 'A: /[0-9]+\\/' + DOT + '/' in out
    assert "B: /./s" in out
    assert '"\\\\d."' in out and "// a comment with /\\d/" in out


# every pattern x every string: Python's re over the translation == JavaScript over the original
PATTERNS = [
    r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", ".", r"[\d.]", r"[^\d]", r"[\D]", r"[^\D]",
    r"[\w-]", r"[^\s\d]", r"[\S\s]", r"\\d", r"[\b]", r"\d{2}", r"[a\Wb]", r"(?:\d|\s)+",
    r"\.", r"[.]", r"[^\W_]", r"[\s\u2028x]", r"\S+\s", r"[^.]",
]
STRINGS = [
    "0", "9", "\u0663", "\U0001FBF8", "a", "Z", "_", "\u00e9", " ", "\t", "\n", "\r", "\x0b", "\x0c",
    "\u2028", "\u2029", "\u00a0", "\u1680", "\u2005", "\u3000", "\ufeff", "\u200b", "\x85", "\u180e",
    "-", ".", "\x08", "\\d", "12", "1a", "ab ", "\U0001F600", "x",
]


def _javascript(patterns: list[str], strings: list[str]) -> list[list[bool]]:
    script = (
        "const [ps, ss] = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "console.log(JSON.stringify(ps.map(p => { const r = new RegExp('^(?:' + p + ')$', 'u');"
        " return ss.map(s => r.test(s)); })));"
    )
    done = subprocess.run(
        ["node", "-e", script], input=json.dumps([patterns, strings]), capture_output=True,
        text=True, timeout=60, check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node as the ECMA-262 reference")
def test_agrees_with_javascript():
    expected = _javascript(PATTERNS, STRINGS)
    for pattern, row in zip(PATTERNS, expected):
        translated = re.compile(ecma_regex(pattern))
        for s, want in zip(STRINGS, row):
            assert (translated.fullmatch(s) is not None) == want, (pattern, s)


@pytest.mark.parametrize("pattern, valid, invalid", [
    # ECMA-262: "[" inside a class is a literal, not Rust's nested class (MaskBench o58776)
    ("^[[a-z]*[-]?[a-z]*]*$", ["", "ab", "[a", "a-b]", "[]]"], ["*?", "?", "*", "ab*"]),
    ("^[a&&b]+$", ["a&b", "&&"], ["c", ""]),
    ("^[[:alpha:]]$", ["[]", ":]", "a]"], ["a", "x]", "[x]"]),
])
def test_brackets_inside_a_class_are_literals(compiler, tok, pattern, valid, invalid):
    from constraints import ConstraintSpec

    from .conftest import walk_json

    compiled = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "pattern": pattern}))
    for text in valid:
        assert walk_json(compiled, tok, text), text
    for text in invalid:
        assert not walk_json(compiled, tok, text), text


def test_lark_keeps_nested_classes():
    assert ecma_regex("[[a-z]]", nested_classes=True) == "[[a-z]]"
    assert ecma_lark("start: /[[a-z]&&[^x]]+/\n") == "start: /[[a-z]&&[^x]]+/\n"
