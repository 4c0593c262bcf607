"""Productivity of grammars: does the start rule derive any finite string at all?

A grammar such as ``root ::= "a" root`` has no finite string; an automaton for it forces text
forever. A nonterminal is *productive* when one of its alternatives consists of terminals and
productive nonterminals; the grammar's language is empty when its start rule is not.

Grammars are read into a small expression form: EBNF after xgrammar normalised it (its printed
form), JSON schemas through xgrammar's schema-to-EBNF conversion, Lark by a reader of its
syntax. Whatever a reader does not understand makes it give up (``None``): the question is
then left to the backends, never answered with a guess.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from ..errors import EmptyLanguageError
from ..schema.keywords import ANNOTATIONS
from ..schema.tree import at_pointer

# expressions: ("t",) terminal | ("ref", name) | ("seq", [e]) | ("alt", [e]) | ("opt", e) | ("plus", e)
Expr = tuple
Rules = dict[str, Expr]
_T: Expr = ("t",)


class _GiveUp(Exception):
    """The text uses syntax this reader does not know."""


# -- productivity -------------------------------------------------------------------------------


def productive(rules: Rules) -> set[str]:
    """The productive rule names (undefined names count as productive: the backends judge them)."""
    prods: list[tuple[str, list[str]]] = []  # (head, nonterminals the alternative needs)
    aux = _Flattener(rules, prods)
    for name, expr in rules.items():
        aux.add(name, expr)
    need = [0] * len(prods)  # per production: needed nonterminals not yet known productive
    users: dict[str, list[int]] = {}  # nonterminal -> its occurrences (production indices)
    for i, (_, body) in enumerate(prods):
        for s in body:
            if s in aux.defined:
                need[i] += 1
                users.setdefault(s, []).append(i)
    done: set[str] = set()
    todo = [head for i, (head, _) in enumerate(prods) if need[i] == 0]
    while todo:
        head = todo.pop()
        if head in done:
            continue
        done.add(head)
        for i in users.get(head, ()):
            need[i] -= 1
            if need[i] == 0:
                todo.append(prods[i][0])
    return {name for name in done if name in rules}


class _Flattener:
    """Rules -> productions "head needs these nonterminals", groups becoming auxiliary rules."""

    def __init__(self, rules: Rules, out: list[tuple[str, list[str]]]) -> None:
        self.out = out
        self.defined = set(rules)
        self._count = 0

    def add(self, head: str, expr: Expr) -> None:
        for alt in _alternatives(expr):
            self.out.append((head, self.needs(alt)))

    def needs(self, expr: Expr) -> list[str]:
        kind = expr[0]
        if kind in ("t", "opt"):
            return []
        if kind == "ref":
            return [expr[1]]
        if kind == "plus":
            return self.needs(expr[1])
        if kind == "seq":
            return [s for item in expr[1] for s in self.needs(item)]
        name = f"\0{self._count}"  # an alternation inside a sequence: its own rule
        self._count += 1
        self.defined.add(name)
        self.add(name, expr)
        return [name]


def _alternatives(expr: Expr) -> list[Expr]:
    if expr[0] == "alt":
        return [a for child in expr[1] for a in _alternatives(child)]
    return [expr]


def check_productive(rules: Rules | None, start: str, what: str) -> None:
    """EmptyLanguageError when ``start`` derives no finite string."""
    if rules is None or start not in rules:
        return
    good = productive(rules)
    if start in good:
        return
    stuck = sorted(name for name in rules if name not in good and not name.startswith("\0"))
    shown = ", ".join(stuck[:5]) + (", ..." if len(stuck) > 5 else "")
    raise EmptyLanguageError(
        f"the {what} admits no finite output: rule {start!r} never reaches a base case "
        f"(rules without a finite expansion: {shown})"
    )


# -- EBNF (xgrammar's printed, normalised form) ----------------------------------------------


_EBNF_TOKEN = re.compile(
    r"""\s+
    | (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\])
    | (?P<look>\(=)
    | (?P<rep>\{\s*\d+\s*(?:,\s*-?\d+\s*)?\})
    | (?P<op>[()|*+?])
    | (?P<name>[A-Za-z_][\w.\-]*)""",
    re.X | re.S,
)
_EBNF_RULE = re.compile(r"^([A-Za-z_][\w.\-]*)\s*::=\s*(.*)$")


def ebnf_rules(printed: str) -> Rules | None:
    """Rules of a grammar in xgrammar's printed form (one ``name ::= body`` per line)."""
    rules: Rules = {}
    try:
        for line in printed.splitlines():
            if not line.strip():
                continue
            m = _EBNF_RULE.match(line.strip())
            if not m:
                raise _GiveUp(line)
            rules[m.group(1)] = _Parser(list(_tokens(_EBNF_TOKEN, m.group(2))), ebnf=True).expression_end()
    except (_GiveUp, RecursionError):
        return None
    return rules


def check_ebnf_productive(text: str) -> None:
    """EmptyLanguageError when the EBNF grammar's ``root`` derives no finite string."""
    import xgrammar as xgr

    try:
        printed = str(xgr.Grammar.from_ebnf(text))
    except Exception:  # invalid grammars are the backend's to report
        return
    check_productive(ebnf_rules(printed), "root", "grammar")


_NO_CONTENT = ANNOTATIONS | {"$ref", "$defs", "definitions"}  # a subschema of these keys is its reference alone
EMPTY_RECURSION = ("the schema admits no finite JSON value: it recurses (through $ref or required "
                   "properties) with no way to stop")


def check_schema_productive(schema: Any) -> None:
    """EmptyLanguageError when no finite JSON value fits ``schema`` for lack of a base case
    (a pure $ref cycle, an object requiring a property of its own type, ...)."""
    import xgrammar as xgr

    if _bare_reference_cycle(schema):  # found here: xgrammar 0.2.9 refuses it as circular before printing rules
        raise EmptyLanguageError(EMPTY_RECURSION)
    try:
        printed = str(xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=False))
    except Exception:  # what xgrammar cannot convert, the backends judge
        return
    rules = ebnf_rules(printed)
    if rules is not None and "root" in rules and "root" not in productive(rules):
        raise EmptyLanguageError(EMPTY_RECURSION)


def _bare_reference_cycle(schema: Any) -> bool:
    """Whether the root is a chain of local ``$ref`` s, each subschema nothing but its
    reference, that comes back to a subschema already on it."""
    node, seen = schema, set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") \
            and set(node) <= _NO_CONTENT:
        pointer = node["$ref"][1:]
        if pointer in seen:
            return True
        seen.add(pointer)
        node = at_pointer(schema, pointer)
    return False


# -- Lark ---------------------------------------------------------------------------------------


_LARK_TOKEN = re.compile(
    r"""\s+ | //[^\n]*
    | (?P<str>"(?:[^"\\\n]|\\.)*"i?)
    | (?P<re>/(?:[^/\\\n]|\\.)+/[imslux]*)
    | (?P<special><\[[\d,\s-]*\]>|<[^<>\s]+>)
    | (?P<dots>\.\.)
    | (?P<tilde>~\s*\d+(?:\s*\.\.\s*\d+)?)
    | (?P<arrow>->\s*[A-Za-z_]\w*)
    | (?P<op>[()\[\]|*+?])
    | (?P<name>[A-Za-z_]\w*)""",
    re.X | re.S,
)
_LARK_HEAD = re.compile(r"^[?!]?([A-Za-z_]\w*)(\s*\.\s*-?\d+)?\s*:(?!:)\s*")


def lark_rules(text: str) -> Rules | None:
    """Rules and terminals of a Lark grammar (llguidance's dialect), or None."""
    rules: Rules = {}
    try:
        for stmt in _lark_statements(text):
            if stmt.startswith("%"):
                _lark_directive(stmt, rules)
                continue
            m = _LARK_HEAD.match(stmt)
            if not m:
                raise _GiveUp(stmt[:40])
            body = _strip_json_blocks(stmt[m.end():])
            expr = _Parser(list(_tokens(_LARK_TOKEN, body)), ebnf=False).expression_end()
            name = m.group(1)
            rules[name] = ("alt", [rules[name], expr]) if name in rules else expr
    except (_GiveUp, RecursionError):
        return None
    return rules


def check_lark_productive(text: str) -> None:
    """EmptyLanguageError when the Lark grammar's ``start`` derives no finite string."""
    check_productive(lark_rules(text), "start", "grammar")


def _lark_statements(text: str) -> Iterator[str]:
    current: list[str] = []
    depth = 0  # inside a multi-line {...} block (JSON after %llguidance / %json)
    for line in text.splitlines():
        stripped = line.strip()
        starts = depth == 0 and (stripped.startswith("%") or _LARK_HEAD.match(stripped) is not None)
        if starts and current:
            yield "\n".join(current)
            current = []
        if stripped or current:
            current.append(stripped)
        depth = max(0, depth + _brace_balance(stripped))
    if current:
        yield "\n".join(current)


_QUOTED = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/')


def _brace_balance(line: str) -> int:
    if "{" not in line and "}" not in line:
        return 0
    bare = _QUOTED.sub("", line)
    return bare.count("{") - bare.count("}")


def _lark_directive(stmt: str, rules: Rules) -> None:
    word = stmt.split(None, 1)[0]
    if word in ("%ignore", "%llguidance", "%override", "%extend"):
        return
    if word == "%declare":
        for name in stmt.split()[1:]:
            rules.setdefault(name, _T)
        return
    if word == "%import":  # %import common.WS, %import common (A, B), ... -> productive
        names = re.findall(r"[A-Za-z_]\w*", stmt.split(None, 1)[1] if " " in stmt else "")
        for name in names:
            rules.setdefault(name, _T)
        if "->" in stmt:
            rules.setdefault(stmt.rsplit("->", 1)[1].strip(), _T)
        return
    raise _GiveUp(word)


def _strip_json_blocks(body: str) -> str:
    """``%json {...}`` (and llguidance's other ``%name {...}`` items) -> a terminal placeholder."""
    out, i = [], 0
    while True:
        j = body.find("%", i)
        if j < 0:
            out.append(body[i:])
            return "".join(out)
        m = re.match(r"%[A-Za-z_]\w*\s*", body[j:])
        if not m or not body[j + m.end():].startswith("{"):
            raise _GiveUp(body[j:j + 20])
        end = _block_end(body, j + m.end())
        out.append(body[i:j] + ' "%" ')
        i = end


def _block_end(text: str, start: int) -> int:
    depth, i, in_str = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _GiveUp("unbalanced {")


# -- a shared expression parser -----------------------------------------------------------------


def _tokens(pattern: re.Pattern, text: str) -> Iterator[tuple[str, str]]:
    pos = 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if not m or m.end() == pos:
            raise _GiveUp(text[pos:pos + 20])
        pos = m.end()
        if m.lastgroup:
            yield m.lastgroup, m.group(m.lastgroup)


class _Parser:
    """expr := seq ('|' seq)*; seq := item*; item := atom postfix*."""

    def __init__(self, tokens: list[tuple[str, str]], ebnf: bool) -> None:
        self.toks = tokens
        self.i = 0
        self.ebnf = ebnf

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expression_end(self) -> Expr:
        expr = self.expression()
        if self.peek() is not None and self.peek()[0] == "look" and self.ebnf:
            self.take()  # a rule's trailing lookahead: it only narrows where the rule may end
            self.expression()
            self.expect(")")
        if self.peek() is not None:
            raise _GiveUp(str(self.peek()))
        return expr

    def expect(self, op: str) -> None:
        tok = self.peek()
        if tok != ("op", op):
            raise _GiveUp(f"expected {op}")
        self.take()

    def expression(self) -> Expr:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.sequence())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self) -> Expr:
        items = []
        while True:
            tok = self.peek()
            if tok is None or tok in (("op", "|"), ("op", ")"), ("op", "]")) or tok[0] in ("look", "arrow"):
                break
            items.append(self.item())
        if self.peek() is not None and self.peek()[0] == "arrow":
            self.take()  # Lark's alias: a name for the tree, nothing for the language
        return items[0] if len(items) == 1 else ("seq", items)

    def item(self) -> Expr:
        expr = self.atom()
        while (tok := self.peek()) is not None:
            kind, text = tok
            if kind == "op" and text in "*?":
                expr = ("opt", expr)
            elif kind == "op" and text == "+":
                expr = ("plus", expr)
            elif kind == "rep" or kind == "tilde":
                low = int(re.findall(r"\d+", text)[0])
                expr = ("plus", expr) if low > 0 else ("opt", expr)
            else:
                break
            self.take()
        return expr

    def atom(self) -> Expr:
        kind, text = self.take()
        if kind in ("str", "cls", "re", "special"):
            if kind == "str" and self.peek() is not None and self.peek()[0] == "dots":
                self.take()
                if self.take()[0] != "str":
                    raise _GiveUp("range")
            return _T
        if kind == "name":
            if self.peek() == ("op", "(") and self.ebnf:
                raise _GiveUp(text)  # a macro such as TagDispatch(...)
            return ("ref", text)
        if kind == "op" and text == "(":
            expr = self.expression()
            self.expect(")")
            return expr
        if kind == "op" and text == "[" and not self.ebnf:
            expr = self.expression()
            self.expect("]")
            return ("opt", expr)
        raise _GiveUp(text)
