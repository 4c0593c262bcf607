"""``format: "regex"`` (constraints/schema/regex_format.py): every string the pattern accepts
compiles as an ECMA-262 regex (node's ``RegExp``, with and without the ``u`` flag, where node is
installed) and with Python's ``re`` (jsonschema's format checker), warnings as errors.

Strings are drawn at random from the pattern itself (walking Python's parse of it), and mutated
one character at a time: each mutant the pattern accepts must compile too."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import warnings
from re import _constants as C
from re import _parser

import pytest

from constraints import ConstraintSpec
from constraints.schema.formats import format_keywords
from constraints.schema.regex_format import MAX_GROUP_DEPTH

from .conftest import walk_json

PATTERN = format_keywords("regex")["pattern"]
MATCHER = re.compile(PATTERN)
VALID = ["", "^[a-zA-Z0-9_]{3,16}$", "^[a-zA-Z0-9]+$", "^\\s*(it|describe)\\(\\s*['\"]([^'\"]+)['\"]",
         "^\\s*describe\\(\\s*['\"]([^'\"]+)['\"]\\s*,\\s*function\\(\\s*\\)\\s*\\{", "^example$", "^value1|value2$",
         "old text", "^/api/(.*)$", "(((a)))", "a{2,3}", "x{10,20}", "x{5,100}", "x{0}", "x{7,}?", "a*?b+?c??",
         r"(?=.*\d)(?!(a))x{8,}", r"\bword\B", "[\\]\\-]", "(?:a||b)|", r"[\^.]\/", "a/b",
         "[a-zA-Z0-9-_]", "[-a]", "[a-]", "[^-]", "[-]", "[A-z]", "[a-c-e-g]", r"[\w-]", r"[-\d]"]
INVALID = ["*", "\\", "[", "]", "(", ")", "a)", "(((a))", "(((((a)))))", "[z-a]", "[9-0]", "a{3,2}", "x{20,10}",
           "a**", "a*+", "(?=a)*", "^*", r"\b+", "[]", "[^]", r"[\w-a]", "[--]", "[a--]", "[a-c--]", r"\q", r"\1",
           "(?<=a)b", "(?P<n>a)", "a{", "a}", "{1}", "\\'", "((?=a))", "[[]", "[&&]", "\x00", "é"]


def _sample(nodes: list, rng: random.Random) -> str:
    """A random string matching the parsed pattern ``nodes`` (``re``'s parse tree)."""
    return "".join(_sample_node(op, arg, rng) for op, arg in nodes)


def _sample_node(op, arg, rng: random.Random) -> str:
    if op is C.LITERAL:
        return chr(arg)
    if op is C.IN:
        items = [_class_member(kind, value) for kind, value in arg]
        lo, hi = rng.choice(items)
        return chr(rng.randint(lo, hi))
    if op is C.BRANCH:
        return _sample(rng.choice(arg[1]), rng)
    if op is C.SUBPATTERN:
        return _sample(arg[3], rng)
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):
        lo, hi, body = arg
        count = lo
        while count < min(hi, lo + 12) and rng.random() < 0.8:
            count += 1
        return "".join(_sample(body, rng) for _ in range(count))
    if op is C.AT:
        return ""
    raise AssertionError(f"unexpected {op} in the regex format's pattern")


def _class_member(kind, value) -> tuple[int, int]:
    if kind is C.LITERAL:
        return value, value
    if kind is C.RANGE:
        return value
    raise AssertionError(f"unexpected {kind} in a class of the regex format's pattern")


def _samples(count: int, seed: int) -> list[str]:
    rng, tree, out = random.Random(seed), _parser.parse(PATTERN), []
    while len(out) < count:
        text = _sample(tree, rng)
        if len(text) <= 600:
            out.append(text)
    return out


def _mutants(texts: list[str], seed: int) -> list[str]:
    """Each text with one character inserted, deleted or replaced, kept when the pattern still
    accepts it."""
    rng, alphabet, out = random.Random(seed), "()[]{}|^$\\.*+?-,:=!a0zZ9 ", []
    for text in texts:
        for _ in range(20):
            at = rng.randint(0, len(text))
            choice = rng.randrange(3)
            cut = at + (1 if choice else 0)
            mutant = text[:at] + ("" if choice == 1 else rng.choice(alphabet)) + text[cut:]
            if MATCHER.fullmatch(mutant):
                out.append(mutant)
    return out


def _python_compiles(text: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            re.compile(text)
        except (re.error, FutureWarning, DeprecationWarning):
            return False
    return True


_NODE_CHECK = """
const texts = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const bad = [];
for (const t of texts) for (const flags of ['', 'u']) {
  try { new RegExp(t, flags); } catch (e) { bad.push([t, flags]); }
}
process.stdout.write(JSON.stringify(bad));
"""


def _ecma_rejects(texts: list[str]) -> list:
    """The texts (with flags) node's ``RegExp`` throws on."""
    done = subprocess.run(["node", "-e", _NODE_CHECK], input=json.dumps(texts), capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_fixed_cases_are_classified():
    assert [t for t in VALID if not MATCHER.fullmatch(t)] == []
    assert [t for t in INVALID if MATCHER.fullmatch(t)] == []
    assert [t for t in VALID if not _python_compiles(t)] == []


def test_the_depth_bound_is_exact():
    inside = "a"
    for depth in range(MAX_GROUP_DEPTH + 2):
        assert bool(MATCHER.fullmatch(inside)) == (depth <= MAX_GROUP_DEPTH)
        inside = f"(?:{inside}|b)*" if depth % 2 else f"({inside})"


def test_ranges_and_counts_in_order_exactly():
    alnum = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for lo in alnum:
        for hi in alnum:
            assert bool(MATCHER.fullmatch(f"[{lo}-{hi}]")) == (lo <= hi), (lo, hi)
    assert not MATCHER.fullmatch("[!-~]")  # ranges between other characters are left out
    for m in range(0, 120):
        for n in list(range(0, 120)) + [999, 1000]:
            accepted = bool(MATCHER.fullmatch(f"a{{{m},{n}}}"))
            assert accepted == (m <= n < 1000 and m < 100), (m, n)
            if accepted:
                assert _python_compiles(f"a{{{m},{n}}}")


def test_random_strings_of_the_language_compile_in_python():
    texts = _samples(400, seed=1)
    assert any(t.count("(") >= 3 for t in texts) and any("[" in t for t in texts) and any("{" in t for t in texts)
    texts += _mutants(texts[:100], seed=2)
    assert [t for t in texts if not MATCHER.fullmatch(t)] == []  # the sampler stays inside
    assert [t for t in texts if not _python_compiles(t)] == []


@pytest.mark.skipif(shutil.which("node") is None, reason="node (a real ECMA-262 engine) is not installed")
def test_random_strings_of_the_language_compile_in_ecma_262():
    texts = _samples(400, seed=3) + VALID
    texts += _mutants(texts[:100], seed=4)
    assert _ecma_rejects(texts) == []
    assert {t for t, _ in _ecma_rejects(INVALID)} >= {"*", "[z-a]", "a{3,2}", "a**", "("}


def test_the_format_is_enforced_token_by_token(compiler, tok):
    compiled = compiler.compile(ConstraintSpec("json_schema", {"type": "string", "format": "regex"}))
    assert [t for t in VALID if not walk_json(compiled, tok, t)] == []
    assert [t for t in INVALID if walk_json(compiled, tok, t)] == []
