"""Errors the control plane returns to clients, with the status each transport maps them to."""

from __future__ import annotations

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
