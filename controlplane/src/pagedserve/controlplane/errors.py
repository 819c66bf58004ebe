"""Errors the control plane returns to clients: the status each transport maps them to, the
Anthropic shape of an HTTP error, and a data plane's failure reworded as the client named its
cause.

The data plane knows a request only by its wire fields: a constraint it cannot compile is
"json_schema could not be compiled ...", a deadline is "the request's deadline passed ...".
The client set them as something else (`response_format.json_schema.schema`, a body's
`timeout`, the call's gRPC deadline, the server's `--request-timeout`): its error says so.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from pagedserve.common.sampling_params import SamplingParams

# gRPC status name -> HTTP status (the OpenAI front end uses the same errors).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "INTERNAL": 500,
}


class ServiceError(Exception):
    """A request failed with `code` (a gRPC status name) and a message for the client.

    `param`: the request field the message is about, as the client named it (the OpenAI error
    JSON reports it; gRPC messages name the field in their text).
    """

    def __init__(
        self, code: str, message: str, retry_after_s: float | None = None, param: str | None = None
    ) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown status code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param
        self.counted = False  # set once a failure metric has recorded it

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]


def invalid_argument(message: str, param: str | None = None) -> ServiceError:
    return ServiceError("INVALID_ARGUMENT", message, param=param)


def clip(text: str, limit: int = 64) -> str:
    """`text` shortened for an error message: a client's value is never echoed unbounded."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def json_type(value: object) -> str:
    """A value's JSON type, as a client knows it ("a string", "an object", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# Anthropic's error shape, for every error a request to the Messages API gets (a refused field,
# a missing key, an unknown route under it, an oversize body, an error mid-stream). It sits here,
# not in the Anthropic routes' package, because the OpenAI error handlers, which answer every HTTP
# error, choose it by path: `{"type": "error", "error": {"type": ..., "message": ...}}` with the
# HTTP status the gRPC code maps to.
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


class NamedCauses(Protocol):
    """What a request records of where the client set its constraint and its deadline
    (`GenerationRequest` has these fields)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def constraint_field(self) -> str: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def deadline_source(self) -> str: ...
    @property
    def deadline_param(self) -> str | None: ...


def named_error(gen: NamedCauses, exc: ServiceError) -> ServiceError:
    """`exc` with the constraint or the deadline behind it named as the client named it."""
    return _named_deadline_error(gen, _named_constraint_error(gen, exc))


def _renamed(exc: ServiceError, message: str, param: str | None) -> ServiceError:
    named = ServiceError(exc.code, message, exc.retry_after_s, param=param)
    named.counted = exc.counted
    return named


def _named_constraint_error(gen: NamedCauses, exc: ServiceError) -> ServiceError:
    """A data plane's refusal of a constraint ("json_schema could not be compiled: ...") with
    the constraint named as the client named it (e.g. "response_format.json_schema.schema ...")."""
    constraint = gen.sampling_params.constraint
    if (
        constraint is None
        or exc.code != "INVALID_ARGUMENT"
        or not exc.message.startswith(constraint.kind + " ")
    ):
        return exc
    message = gen.constraint_field + exc.message[len(constraint.kind) :]
    return _renamed(exc, message, gen.constraint_field)


def _named_deadline_error(gen: NamedCauses, exc: ServiceError) -> ServiceError:
    """DEADLINE_EXCEEDED once the request's own deadline has passed (the data plane dropped it,
    or it was still queued) names what set that deadline: "timeout of 2 s: ...". One that came
    sooner (the queue timeout) is left as it is."""
    if exc.code != "DEADLINE_EXCEEDED" or gen.deadline is None or time.monotonic() < gen.deadline:
        return exc
    return _renamed(exc, f"{gen.deadline_source}: {exc.message}", gen.deadline_param or exc.param)
