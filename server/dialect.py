"""The model router's dialect: ``/v0`` routes, ``model@provider``, ``drop_params``, tags.

On ``/v0`` (and on ``/v1`` with ``drop_params: true``) a parameter this server does not support is
dropped instead of refused, and every dropped name is listed in the ``x-trellis-dropped-params``
response header, so nothing is dropped silently.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote

import msgspec

from server.errors import APIError

PROVIDER = "trellis"
DROPPED_HEADER = "x-trellis-dropped-params"
_MAX_DROPS = 64
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_FIELD_AT = re.compile(r"at `\$(.*)`$")
_INDEX = re.compile(r"\[(\d+)\]")

_route_drops_params: ContextVar[bool] = ContextVar("trellis_route_drops_params", default=False)


def use_router_dialect() -> None:
    """Called by the ``/v0`` handlers: parameters this server lacks are dropped by default there."""
    _route_drops_params.set(True)


def on_router_dialect() -> bool:
    """Whether the current request came in on a ``/v0`` route."""
    return _route_drops_params.get()


def drops_params(data: dict[str, Any]) -> bool:
    """The request's ``drop_params``, else the route's default."""
    value = data.get("drop_params")
    if value is None:
        return _route_drops_params.get()
    if not isinstance(value, bool):
        raise APIError("'drop_params' must be a boolean", param="drop_params", code="invalid_type")
    return value


def convert_dropping_unknown(data: dict[str, Any], cls: type) -> tuple[Any, list[str]]:
    """``msgspec.convert(data, cls)``, removing each unknown field it names; returns (value, dropped)."""
    dropped: list[str] = []
    while True:
        try:
            return msgspec.convert(data, cls), dropped
        except msgspec.ValidationError as exc:
            name = _unknown_field_path(str(exc))
            if name is None or len(dropped) >= _MAX_DROPS or not _remove(data, name):
                raise
            dropped.append(name)


def _unknown_field_path(message: str) -> str | None:
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown is None:
        return None
    where = _FIELD_AT.search(message)
    prefix = where.group(1).lstrip(".") if where else ""
    return f"{prefix}.{unknown.group(1)}" if prefix else unknown.group(1)


def _remove(data: Any, path: str) -> bool:
    """Delete ``a.b[2].c`` from nested dicts/lists; False when it is not there."""
    keys: list[Any] = []
    for part in path.split("."):
        name = _INDEX.split(part)
        if name[0]:
            keys.append(name[0])
        keys.extend(int(i) for i in name[1::2])
    node = data
    for key in keys[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(node, dict) and keys and keys[-1] in node:
        del node[keys[-1]]
        return True
    return False


def dropped_header_value(names: list[str]) -> bytes:
    """Comma-separated names, percent-encoded where a client's field name is not header-safe."""
    return ",".join(quote(name, safe="._[]-$") for name in names).encode("ascii")


def split_model(model: str | None, aliases: frozenset[str]) -> tuple[str | None, str | None]:
    """``name@provider`` → (name, provider); a model without ``@`` has no provider."""
    if model is None or "@" not in model:
        return model, None
    name, _, provider = model.rpartition("@")
    if provider != PROVIDER and provider not in aliases:
        raise APIError(f"unknown provider {provider!r} in model {model!r}; this server is '{PROVIDER}'"
                       + (f" (aliases: {', '.join(sorted(aliases))})" if aliases else ""),
                       status=404, param="model", code="model_not_found")
    return name, provider


def normalise_tags(data: dict[str, Any]) -> None:
    """``tags`` as an array or a comma-separated string → a list of non-empty strings, in place."""
    tags = data.get("tags")
    if isinstance(tags, str):
        data["tags"] = [tag.strip() for tag in tags.split(",") if tag.strip()]
