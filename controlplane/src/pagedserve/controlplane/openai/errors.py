"""OpenAI's error JSON for every failure of the HTTP API, and the handlers that produce it.

Every error, including a body that is not JSON, a route that does not exist or a wrong method,
is `{"error": {"message", "type", "param", "code"}}` with `param` naming the field the message
is about, and the status the gRPC code maps to (400 bad field, 401, 404, 405, 413, 429 queue
full, 503 no data plane); anything unexpected is a logged 500. A request under Anthropic's
`/v1/messages` gets the same errors in Anthropic's shape (`pagedserve.controlplane.errors`):
every function here that answers takes the request's `path` for that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.common.log import get_logger
from pagedserve.controlplane.errors import (
    ServiceError,
    anthropic_error_body,
    clip,
    invalid_argument,
    speaks_anthropic,
)
from pagedserve.controlplane.frontend import Frontend

log = get_logger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# Pydantic's names for the members of a union field (they appear in an error's location).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def error_body(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def _shaped(path: str, status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    if speaks_anthropic(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def openai_error(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """An error that exists only over HTTP (404 route, 405, 413), in OpenAI's error JSON (or
    Anthropic's, for a `path` of its API)."""
    code = _HTTP_CODES.get(status, "internal" if status >= 500 else "invalid_request")
    body = _shaped(path, status, message, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(exc: ServiceError, param: str | None = None, path: str = "") -> JSONResponse:
    status = exc.http_status
    body = _shaped(path, status, exc.message, param or exc.param, exc.code.lower())
    headers = {"retry-after": f"{max(1, round(exc.retry_after_s))}"} if exc.retry_after_s else None
    return JSONResponse(body, status_code=status, headers=headers)


def field_location(loc: Sequence[Any]) -> tuple[str | None, bool]:
    """A pydantic error location as the client names the field (`messages[0].role`), and
    whether it ran into a union (the part after that names one alternative's guess only)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part:
            return (clip(out, 128) if out else None), True
        else:
            out += f".{part}" if out else part
    return (clip(out, 128) if out else None), False


def describe_validation_error(
    errors: Sequence[Any], content_type: str = "application/json"
) -> tuple[str, str | None]:
    """(message, param) for FastAPI's errors about a request body sent as `content_type`."""
    if not errors:
        return "the request is not valid", None
    first = errors[0]
    kind = first.get("type")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "decode error")
        return f"the request body is not valid JSON: {reason}", None
    if not loc:
        if "json" not in content_type.lower():  # FastAPI parses JSON only when told it is JSON
            got = clip(content_type, 48) if content_type else "none"
            return (
                f"the request body must be JSON, sent with content-type: application/json (got {got})",
                None,
            )
        if kind == "missing":
            return "the request body is missing: send a JSON object", None
        return "the request body must be a JSON object", None
    param, union = field_location(loc)
    if union:  # no member of a union field matched: the first member's complaint misleads
        return f"{param}: not any of the accepted forms ({first.get('msg', 'invalid value')})", param
    return f"{param}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI, frontend: Frontend) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors(), request.headers.get("content-type", ""))
        error = invalid_argument(message, param)
        frontend.record_failure(error)
        return error_response(error, path=request.url.path)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        frontend.record_failure(exc)
        return error_response(exc, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = clip(request.url.path, 128)
        if exc.status_code == 404:
            message = f"no such route: {request.method} {path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
        else:
            message = str(exc.detail)
        headers = dict(exc.headers or {}) or None
        return openai_error(exc.status_code, message, headers=headers, path=request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("http_internal_error", path=clip(request.url.path, 128))
        return openai_error(500, "internal server error", path=request.url.path)
