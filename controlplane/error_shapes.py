"""Anthropic's error shape, for every error a request to the Messages API gets (a refused
field, a missing key, an unknown route under it, an oversize body, an error mid-stream). It
lives beside the HTTP server, not in the Anthropic routes' package, because the OpenAI error
handlers, which answer every HTTP error, choose it by path. The shape:
`{"type": "error", "error": {"type": ..., "message": ...}}` with the HTTP status the gRPC code
maps to. The message names the field it is about, as Anthropic's own errors do."""

from __future__ import annotations

from typing import Any

MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    """Whether a request for `path` is answered in Anthropic's shapes."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
