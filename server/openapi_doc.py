"""Request and response bodies in the OpenAPI document at ``/docs/openapi.json``.

The generation handlers read their body themselves (``extra_body`` merge, errors naming the field),
so Litestar cannot infer it; the schemas come from the same msgspec Structs that decode the bodies.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Litestar

from server.protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse

_REF = "#/components/schemas/{name}"
_BODIES = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion),
    "/v1/completions": (CompletionRequest, Completion),
    "/v0/chat/completions": (ChatCompletionRequest, ChatCompletion),
    "/v0/completions": (CompletionRequest, Completion),
}
_ERROR_STATUSES = {
    "400": "invalid request (the field is named in error.param)",
    "404": "unknown model",
    "413": "request body too large",
    "415": "Content-Type is not application/json",
    "429": "waiting queue full (server_overloaded) or the expected wait for a first token over --max-queue-wait (queue_wait_exceeded); see Retry-After",
    "503": "loading, draining or engine stopped",
    "504": "request exceeded the server's time limit",
}


def document_bodies(app: Litestar) -> None:
    """Add request bodies, 200 bodies and error bodies of the generation routes to the document."""
    from litestar._openapi.plugin import OpenAPIPlugin  # the plugin caches the rendered document

    document = app.plugins.get(OpenAPIPlugin).provide_openapi_schema()
    types = list(dict.fromkeys([t for pair in _BODIES.values() for t in pair] + [ErrorResponse]))
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    ref_of = dict(zip(types, refs))
    for path, (request_type, response_type) in _BODIES.items():
        operation = document["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref_of[request_type]}}}
        operation["responses"] = _responses(ref_of[response_type], ref_of[ErrorResponse])
    _document_store_bodies(document, schemas)


def _document_store_bodies(document: dict[str, Any], schemas: dict[str, Any]) -> None:
    from server.store_routes import BODY_STRUCTS

    refs, components = msgspec.json.schema_components(list(BODY_STRUCTS.values()), ref_template=_REF)
    schemas.update(components)
    for ((path, method), _), ref in zip(BODY_STRUCTS.items(), refs):
        operation = document["paths"].get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}


def _responses(ok: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "the completion (JSON), or server-sent events when stream is true",
            "content": {"application/json": {"schema": ok}, "text/event-stream": {"schema": {"type": "string"}}},
        }
    }
    for status, description in _ERROR_STATUSES.items():
        responses[status] = {"description": description, "content": {"application/json": {"schema": error}}}
    return responses
