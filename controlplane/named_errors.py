"""A data plane's (or the queue's) failure of a request, reworded as the client named its cause.

The data plane knows a request only by its wire fields: a constraint it cannot compile is
"json_schema could not be compiled ...", a deadline is "the request's deadline passed ...".
The client set them as something else (`response_format.json_schema.schema`, a body's
`timeout`, the call's gRPC deadline, the server's `--request-timeout`): its error says so.
"""

from __future__ import annotations

import time

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.request import GenerationRequest


def named_error(gen: GenerationRequest, exc: ServiceError) -> ServiceError:
    """`exc` with the constraint or the deadline behind it named as the client named it."""
    return _named_deadline_error(gen, _named_constraint_error(gen, exc))


def _renamed(exc: ServiceError, message: str, param: str | None) -> ServiceError:
    named = ServiceError(exc.code, message, exc.retry_after_s, param=param)
    named.counted = exc.counted
    return named


def _named_constraint_error(gen: GenerationRequest, exc: ServiceError) -> ServiceError:
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


def _named_deadline_error(gen: GenerationRequest, exc: ServiceError) -> ServiceError:
    """DEADLINE_EXCEEDED once the request's own deadline has passed (the data plane dropped it,
    or it was still queued) names what set that deadline: "timeout of 2 s: ...". One that came
    sooner (the queue timeout) is left as it is."""
    if exc.code != "DEADLINE_EXCEEDED" or gen.deadline is None or time.monotonic() < gen.deadline:
        return exc
    return _renamed(exc, f"{gen.deadline_source}: {exc.message}", gen.deadline_param or exc.param)
