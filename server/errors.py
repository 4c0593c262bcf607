"""OpenAI-style errors: one exception type for the API layer and the Litestar handlers that map
every failure (ours, constraint compilation, Litestar's own, unexpected) to
``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from constraints import ConstraintError
from server.engine.errors import EngineUnavailable
from server.context import request_id, request_log
from server.protocol import ErrorBody, ErrorResponse

log = logging.getLogger("trellis")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client should see as-is: message, HTTP status, offending field and code."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 naming the offending request field."""
    return APIError(message, status=400, param=param, code=code)


def not_implemented(param: str) -> APIError:
    """A 400 for a field that changes behaviour but is not implemented: never silently ignored."""
    return APIError(
        f"'{param}' is not supported by this server yet; remove it from the request",
        status=400,
        param=param,
        code="unsupported_parameter",
    )


def error_body(error: APIError) -> bytes:
    body = ErrorResponse(
        error=ErrorBody(message=error.message, type=error.type, param=error.param, code=error.code),
        code=error.code,
        message=error.message,
        request_id=request_id(),
    )
    return msgspec.json.encode(body)


def error_response(error: APIError) -> Response:
    request_log().update(error_code=error.code)
    return Response(
        content=error_body(error), status_code=error.status, media_type="application/json", headers=error.headers
    )


def _from_constraint_error(exc: ConstraintError) -> APIError:
    return APIError(exc.message, status=400, param=exc.param, code=exc.code)


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc)


def handle_constraint_error(request: Request, exc: ConstraintError) -> Response:
    server = request.app.state.get("server")
    if server is not None:
        keyword = server.metrics.keyword_labels(exc.keyword)
        server.metrics.refusals.labels(code=exc.code or "none", keyword=keyword).inc()
    return error_response(_from_constraint_error(exc))


_CODE_BY_STATUS = {
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def handle_http_exception(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status >= 500:  # Litestar's own 5xx are internal failures: logged, never shown raw
        log.error("HTTP %s from the framework: %s", status, exc.detail)
    code = _CODE_BY_STATUS.get(status, "invalid_request" if status < 500 else "internal_error")
    return error_response(APIError(str(exc.detail), status=status, code=code))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(
        APIError(f"internal error: {type(exc).__name__}", status=500, code="internal_error")
    )


def handle_engine_unavailable(_: Request, exc: Exception) -> Response:
    return error_response(APIError(f"the engine cannot take requests: {exc}", status=503, code="engine_unavailable"))


EXCEPTION_HANDLERS = {
    EngineUnavailable: handle_engine_unavailable,
    APIError: handle_api_error,
    ConstraintError: handle_constraint_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
