"""ConstraintSpec and the parsing of request fields (OpenAI, vLLM and SGLang wire names)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ConstraintError, ConstraintTooLargeError, InvalidConstraintError, UnsupportedConstraintError

KINDS = frozenset(
    {"json_schema", "json_object", "regex", "grammar_ebnf", "grammar_lark", "choice", "structural_tag"}
)
BACKENDS = frozenset({"auto", "xgrammar", "llguidance", "outlines"})
_BACKEND_ALIASES = {"guidance": "llguidance", "outlines-core": "outlines", "outlines_core": "outlines"}
# JSON nesting of a schema / structural tag: well below the interpreter's recursion limit, so
# hashing and pickling a spec cannot overflow; the schema's own level budget is checked later
MAX_SOURCE_DEPTH = 512
# JSON text layouts: "dumps" is Python's json.dumps(obj) (", " and ": ", one line), "compact"
# is json.dumps(obj, separators=(",", ":")), "flexible" allows bounded whitespace between tokens
JSON_LAYOUTS = ("dumps", "compact", "flexible")
DEFAULT_JSON_LAYOUT = "dumps"
# How numbers may be spelled under the one-line layouts: "bounded" (the default: at most 17
# significant digits, a 3-digit exponent, constraints.schema.number_form) or "any" JSON number.
# The flexible layout always takes any number.
JSON_NUMBERS = ("bounded", "any")
# Which orders an object's listed properties may be written in: "auto" (the default: objects of
# at most 4 properties in any order, larger ones in the declared order, which carries the schema
# author's intent and is what a small model extracts best in), "any" (every object in any order:
# JSON objects have no order) or "declared" (the order ``properties`` lists them in, as OpenAI's
# structured outputs write them: a "reasoning" key declared first is written first).
JSON_PROPERTY_ORDERS = ("auto", "any", "declared")
_OPTION_DEFAULTS: dict[str, Any] = {
    "strict": True, "backend": "auto", "disable_any_whitespace": False, "json_layout": DEFAULT_JSON_LAYOUT,
    "json_numbers": "bounded", "json_property_order": "auto",
}
_OPTION_TYPES: dict[str, type] = {
    "strict": bool,
    "backend": str,
    "disable_any_whitespace": bool,
    "whitespace_pattern": str,
    "json_layout": str,
    "json_numbers": str,
    "json_property_order": str,
}


# options that take one of a few words, beside json_layout
_CHOICES: dict[str, tuple[str, ...]] = {"json_numbers": JSON_NUMBERS, "json_property_order": JSON_PROPERTY_ORDERS}


def _check_choice(name: str, value: Any, param: str) -> Any:
    """``value`` when it is one of option ``name``'s words; else a 400 naming ``param``."""
    if value not in _CHOICES[name]:
        raise InvalidConstraintError(f"{name} must be one of {', '.join(_CHOICES[name])}, got {value!r}", param=param)
    return value


def _normalise_options(options: Mapping[str, Any] | None) -> Mapping[str, Any]:
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name not in _OPTION_TYPES:
            raise InvalidConstraintError(f"unknown constraint option {name!r}", param=name)
        if value is None:
            continue
        if not isinstance(value, _OPTION_TYPES[name]):
            raise InvalidConstraintError(
                f"option {name!r} must be a {_OPTION_TYPES[name].__name__}", param=name
            )
        if name == "backend":
            value = _normalise_backend(value, name)
        if name in _CHOICES:
            _check_choice(name, value, name)
        out[name] = value
    _resolve_layout(out)
    out = {k: v for k, v in out.items() if v != _OPTION_DEFAULTS.get(k, object())}
    return MappingProxyType(dict(sorted(out.items())))


def _resolve_layout(opts: dict[str, Any]) -> None:
    """Fold the whitespace options into one canonical form: ``json_layout`` (``"compact"`` for
    ``disable_any_whitespace``), or ``whitespace_pattern`` alone (a custom flexible layout)."""
    layout = opts.get("json_layout")
    if layout is not None and layout not in JSON_LAYOUTS:
        raise InvalidConstraintError(
            f"json_layout must be one of {', '.join(JSON_LAYOUTS)}, got {layout!r}", param="json_layout"
        )
    if opts.pop("disable_any_whitespace", False):
        if layout not in (None, "compact"):
            raise InvalidConstraintError(
                f"disable_any_whitespace contradicts json_layout {layout!r}", param="json_layout"
            )
        opts["json_layout"] = layout = "compact"
    if opts.get("whitespace_pattern") is not None:
        if layout not in (None, "flexible"):
            raise InvalidConstraintError(
                f"whitespace_pattern contradicts json_layout {layout!r}", param="json_layout"
            )
        opts.pop("json_layout", None)


def _normalise_backend(value: str, param: str) -> str:
    name = value.split(":", 1)[0].strip().lower()  # vLLM once allowed "xgrammar:no-fallback"
    name = _BACKEND_ALIASES.get(name, name)
    if name not in BACKENDS:
        raise InvalidConstraintError(
            f"unknown structured-output backend {value!r} (use one of {sorted(BACKENDS)})", param=param
        )
    return name


@dataclass(frozen=True, eq=False)
class ConstraintSpec:
    """What the output must match, independent of any backend.

    ``kind`` is one of :data:`KINDS`; ``source`` is the schema dict (``json_schema``), the regex or
    grammar text, the list of choices (``choice``), the structural-tag dict, or ``None``
    (``json_object``). ``options`` may hold ``json_layout`` (one of :data:`JSON_LAYOUTS`,
    default ``"dumps"``), ``whitespace_pattern`` (a custom flexible layout),
    ``disable_any_whitespace`` (stored as ``json_layout="compact"``), ``json_numbers`` (one of
    :data:`JSON_NUMBERS`), ``json_property_order`` (one of :data:`JSON_PROPERTY_ORDERS`),
    ``strict`` (default True) and ``backend`` (default ``"auto"``); defaults are dropped.
    ``param`` (keyword-only, not part of the key) names the request field, for error messages.
    """

    kind: str
    source: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    param: str | None = field(default=None, kw_only=True)  # request field it came from; not in key()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidConstraintError(f"unknown constraint kind {self.kind!r}")
        check_depth(self.source)  # before anything recursive (key(), pickling) touches it
        object.__setattr__(self, "options", _normalise_options(self.options))
        if isinstance(self.source, list):
            object.__setattr__(self, "source", tuple(self.source))
        check_characters(self.key())

    def key(self) -> str:
        """Canonical text of the spec: sorted JSON with normalised options."""
        cached = self.__dict__.get("_key")
        if cached is None:
            payload = {"kind": self.kind, "source": self.source, "options": dict(self.options)}
            cached = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            object.__setattr__(self, "_key", cached)
        return cached

    @property
    def strict(self) -> bool:
        """Whether every keyword must be enforced (the default) rather than best effort."""
        return bool(self.options.get("strict", True))

    @property
    def json_layout(self) -> str:
        """How JSON text is laid out: ``"dumps"`` (default), ``"compact"`` or ``"flexible"``
        (also when a ``whitespace_pattern`` is given)."""
        if self.options.get("whitespace_pattern") is not None:
            return "flexible"
        return str(self.options.get("json_layout", DEFAULT_JSON_LAYOUT))

    @property
    def json_numbers(self) -> str:
        """How numbers may be spelled: ``"bounded"`` (the default under the one-line layouts) or
        ``"any"`` (asked for, or the flexible layout)."""
        if self.json_layout == "flexible":
            return "any"
        return str(self.options.get("json_numbers", "bounded"))

    @property
    def backend(self) -> str:
        """The requested backend, ``"auto"`` unless the request named one."""
        return str(self.options.get("backend", "auto"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstraintSpec) and other.key() == self.key()

    def __reduce__(self):  # options are a read-only mapping, which does not pickle
        return (_rebuild_spec, (self.kind, self.source, dict(self.options), self.param))

    def __hash__(self) -> int:
        return hash(self.key())


def _rebuild_spec(kind: str, source: Any, options: dict[str, Any], param: str | None) -> ConstraintSpec:
    return ConstraintSpec(kind, source, options, param=param)


# Planes 4-11 hold no assigned characters; llguidance 1.9 masks their UTF-8 continuation bytes as
# allowed and then refuses to consume them, so a constraint naming one would fail mid-generation.
_UNASSIGNED_PLANES = re.compile("[\U00040000-\U000BFFFF]")


def check_characters(text: str) -> None:
    """UnsupportedConstraintError for a character from Unicode's unassigned planes (U+40000-U+BFFFF)."""
    found = _UNASSIGNED_PLANES.search(text)
    if found is not None:
        raise UnsupportedConstraintError(
            f"the constraint contains U+{ord(found.group()):X}, from an unassigned Unicode plane; "
            "no tokenizer produces it reliably", keyword="character"
        )


def check_depth(value: Any, limit: int = MAX_SOURCE_DEPTH) -> None:
    """ConstraintTooLargeError when dicts/lists nest deeper than ``limit`` (checked iteratively)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            raise ConstraintTooLargeError(
                f"the constraint nests deeper than {limit} levels", keyword="depth"
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list, tuple)))


# ---------------------------------------------------------------------------------------------
# request parsing

_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(\.\s*-?\d+\s*)?:", re.MULTILINE)
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def grammar_kind(text: str, param: str) -> str:
    """Tell EBNF/GBNF (``root ::= ...``) from Lark (``start: ...``) grammar text."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidConstraintError("grammar must be a non-empty string", param=param)
    if _EBNF_RULE.search(text):
        return "grammar_ebnf"
    if _LARK_RULE.search(text):
        return "grammar_lark"
    raise InvalidConstraintError(
        "grammar is neither EBNF/GBNF (`root ::= ...`) nor Lark (`start: ...`)", param=param
    )


def _json_value(value: Any, param: str) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise InvalidConstraintError(f"not valid JSON: {exc}", param=param) from None
        except RecursionError:
            raise ConstraintTooLargeError(
                f"the constraint nests deeper than {MAX_SOURCE_DEPTH} levels", param=param, keyword="depth"
            ) from None
    return value


def _schema(value: Any, param: str) -> dict:
    value = _json_value(value, param)
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise InvalidConstraintError("the JSON schema must be an object", param=param)
    return value


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidConstraintError("must be a non-empty string", param=param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidConstraintError("choice must be a non-empty list of strings", param=param)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidConstraintError("every choice must be a string", param=f"{param}[{i}]")
    return list(value)


def _structural_tag(value: Any, param: str) -> dict:
    value = _json_value(value, param)
    if not isinstance(value, dict):
        raise InvalidConstraintError("structural tag must be an object", param=param)
    if not ("format" in value or "structures" in value):
        raise InvalidConstraintError(
            "structural tag needs `format` or `structures` + `triggers`", param=param
        )
    return value


def _grammar(value: Any, param: str) -> tuple[str, str]:
    text = _string(value, param)
    return grammar_kind(text, param), text


_Found = list[tuple[str, str, Any]]  # (param, kind, source)


def _from_response_format(rf: Any, found: _Found) -> None:
    if rf is None:
        return
    if not isinstance(rf, Mapping):
        raise InvalidConstraintError("response_format must be an object", param="response_format")
    rtype = rf.get("type")
    if rtype in (None, "text"):
        return
    if rtype == "json_object":
        found.append(("response_format", "json_object", None))
    elif rtype == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise InvalidConstraintError(
                "json_schema must be an object with a `schema`", param="response_format.json_schema"
            )
        param = "response_format.json_schema.schema"
        if "schema" not in js or js["schema"] is None:
            raise InvalidConstraintError("missing the JSON schema", param=param)
        found.append((param, "json_schema", _schema(js["schema"], param)))
    elif rtype == "structural_tag":
        found.append(("response_format", "structural_tag", _structural_tag(dict(rf), "response_format")))
    else:
        raise InvalidConstraintError(
            f"unknown response_format type {rtype!r}", param="response_format.type"
        )


def _from_structured_outputs(so: Any, found: _Found) -> None:
    if so is None:
        return
    p = "structured_outputs"
    if not isinstance(so, Mapping):
        raise InvalidConstraintError("structured_outputs must be an object", param=p)
    if so.get("json") is not None:
        found.append((f"{p}.json", "json_schema", _schema(so["json"], f"{p}.json")))
    if so.get("regex") is not None:
        found.append((f"{p}.regex", "regex", _string(so["regex"], f"{p}.regex")))
    if so.get("choice") is not None:
        found.append((f"{p}.choice", "choice", _choices(so["choice"], f"{p}.choice")))
    if so.get("grammar") is not None:
        found.append((f"{p}.grammar", *_grammar(so["grammar"], f"{p}.grammar")))
    if so.get("json_object"):
        found.append((f"{p}.json_object", "json_object", None))
    if so.get("structural_tag") is not None:
        param = f"{p}.structural_tag"
        found.append((param, "structural_tag", _structural_tag(so["structural_tag"], param)))


def _from_legacy(fields: Mapping[str, Any], found: _Found) -> None:
    if fields.get("guided_json") is not None:
        found.append(("guided_json", "json_schema", _schema(fields["guided_json"], "guided_json")))
    if fields.get("guided_regex") is not None:
        found.append(("guided_regex", "regex", _string(fields["guided_regex"], "guided_regex")))
    if fields.get("guided_choice") is not None:
        found.append(("guided_choice", "choice", _choices(fields["guided_choice"], "guided_choice")))
    if fields.get("guided_grammar") is not None:
        found.append(("guided_grammar", *_grammar(fields["guided_grammar"], "guided_grammar")))


def _from_sglang(fields: Mapping[str, Any], found: _Found) -> None:
    if fields.get("regex") is not None:
        found.append(("regex", "regex", _string(fields["regex"], "regex")))
    if fields.get("ebnf") is not None:
        text = _string(fields["ebnf"], "ebnf")
        found.append(("ebnf", grammar_kind(text, "ebnf"), text))
    if fields.get("json_schema") is not None:
        found.append(("json_schema", "json_schema", _schema(fields["json_schema"], "json_schema")))


def _json_layout(fields: Mapping[str, Any], so: Any, name: str = "json_layout") -> tuple[str, Any] | None:
    """(param, value) of the requested json_layout (or ``name``): structured_outputs', else
    response_format's."""
    if isinstance(so, Mapping) and so.get(name) is not None:
        return f"structured_outputs.{name}", so[name]
    rf = fields.get("response_format")
    js = rf.get("json_schema") if isinstance(rf, Mapping) else None
    if isinstance(js, Mapping) and js.get(name) is not None:
        return f"response_format.json_schema.{name}", js[name]
    return None


def _options(fields: Mapping[str, Any], kind: str, strict: Any) -> dict[str, Any]:
    so = fields.get("structured_outputs") or {}
    opts: dict[str, Any] = {}
    layout = _json_layout(fields, so)
    if layout is not None:
        param, value = layout
        if value not in JSON_LAYOUTS:
            raise InvalidConstraintError(
                f"json_layout must be one of {', '.join(JSON_LAYOUTS)}, got {value!r}", param=param
            )
        opts["json_layout"] = value
    for name in _CHOICES:
        found = _json_layout(fields, so, name)
        if found is not None:
            param, value = found
            opts[name] = _check_choice(name, value, param)
    wsp = so.get("whitespace_pattern") if isinstance(so, Mapping) else None
    wsp = wsp if wsp is not None else fields.get("guided_whitespace_pattern")
    if wsp is not None:
        opts["whitespace_pattern"] = _string(wsp, "guided_whitespace_pattern")
    if isinstance(so, Mapping) and so.get("disable_any_whitespace") is not None:
        opts["disable_any_whitespace"] = bool(so["disable_any_whitespace"])
    backend = fields.get("guided_decoding_backend")
    if isinstance(so, Mapping) and so.get("backend") is not None:
        backend = so["backend"]
    if backend is not None:
        if not isinstance(backend, str):
            raise InvalidConstraintError("backend must be a string", param="guided_decoding_backend")
        opts["backend"] = _normalise_backend(backend, "guided_decoding_backend")
    if strict is False:
        opts["strict"] = False
    if kind not in ("json_schema", "json_object"):
        for name in ("whitespace_pattern", "disable_any_whitespace", "json_layout", "json_numbers", "json_property_order"):
            opts.pop(name, None)
    try:
        _resolve_layout(dict(opts))
    except InvalidConstraintError as exc:
        raise InvalidConstraintError(exc.message, param=layout[0] if layout else "structured_outputs") from None
    return opts


def spec_from_request(fields: Mapping[str, Any]) -> ConstraintSpec | None:
    """Build the ConstraintSpec a request body asks for, or None when it asks for none.

    ``fields`` is the request body as a plain dict in wire format (after ``extra_body`` merge).
    Raises InvalidConstraintError (``param`` = the field path) for malformed values and when
    more than one constraint is given.
    """
    found: _Found = []
    _from_response_format(fields.get("response_format"), found)
    _from_legacy(fields, found)
    _from_structured_outputs(fields.get("structured_outputs"), found)
    _from_sglang(fields, found)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _, _ in found)
        raise InvalidConstraintError(
            f"only one structured-output constraint may be given, got: {names}", param=found[0][0]
        )
    param, kind, source = found[0]
    strict = None
    rf = fields.get("response_format")
    if kind == "json_schema" and param.startswith("response_format") and isinstance(rf, Mapping):
        strict = (rf.get("json_schema") or {}).get("strict")
    try:
        return ConstraintSpec(kind, source, _options(fields, kind, strict), param=param)
    except ConstraintError as exc:
        raise exc.for_param(param) from None


def close_on_length_option(fields: Mapping[str, Any]) -> tuple[bool | None, str]:
    """(value, param) of the request's ``close_on_length``: ``structured_outputs.close_on_length``,
    else ``response_format.json_schema.close_on_length``; value None when the request is silent."""
    so = fields.get("structured_outputs")
    found: list[tuple[Any, str]] = []
    if isinstance(so, Mapping) and so.get("close_on_length") is not None:
        found.append((so["close_on_length"], "structured_outputs.close_on_length"))
    rf = fields.get("response_format")
    js = rf.get("json_schema") if isinstance(rf, Mapping) else None
    if isinstance(js, Mapping) and js.get("close_on_length") is not None:
        found.append((js["close_on_length"], "response_format.json_schema.close_on_length"))
    if not found:
        return None, "structured_outputs.close_on_length"
    for value, param in found:
        if not isinstance(value, bool):
            raise InvalidConstraintError("close_on_length must be a boolean", param=param)
    if len({v for v, _ in found}) > 1:
        raise InvalidConstraintError("close_on_length is given twice with different values", param=found[1][1])
    return found[0]
