"""A request's deadline: the soonest of its sources, and the time left a data plane is sent.

Three sources, the smallest applies: the gRPC call's own deadline, the HTTP body's `timeout`
(seconds; the OpenAI client's `timeout` option is client-side only, so a client that wants the
server to stop working sends it in `extra_body`), and the server's `--request-timeout`. The
deadline bounds the admission queue wait (with `--queue-timeout`) and travels to the data plane
as the time left at each submit (`SubmitCommand.timeout_ms`), where the scheduler drops the
request past it, freeing its blocks. The client gets DEADLINE_EXCEEDED (HTTP 504) after what
was generated so far, where its protocol streams.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pagedserve.controlplane.errors import invalid_argument

MAX_TIMEOUT_S = 86_400.0
"""The longest `timeout` a client may send (a day): beyond it a value is a mistake, not a deadline."""
MAX_TIMEOUT_MS = 2**32 - 1  # what SubmitCommand.timeout_ms holds (49 days)
TIMEOUT_FIELD = "timeout"


@dataclass(frozen=True)
class Deadline:
    """When a request must be done (`time.monotonic()`), and what set it, for error messages."""

    at: float
    source: str  # e.g. "timeout of 2 s"
    param: str | None = None  # the request field that set it, if one did


def check_timeout(value: float, field_name: str = TIMEOUT_FIELD) -> float:
    """A client's timeout in seconds: finite, > 0 and at most MAX_TIMEOUT_S; INVALID_ARGUMENT
    naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid_argument(f"{field_name} must be a finite number of seconds", field_name)
    if not 0 < value <= MAX_TIMEOUT_S:
        raise invalid_argument(
            f"{field_name} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value:g}", field_name
        )
    return float(value)


def request_deadline(
    call_deadline: float | None,
    timeout_s: float | None,
    default_s: float | None,
    now: float | None = None,
) -> Deadline | None:
    """The soonest of the call's deadline (a monotonic instant), `now` + the client's checked
    `timeout_s` and `now` + the server's default; None when none is set."""
    now = time.monotonic() if now is None else now
    candidates = []
    if call_deadline is not None:
        candidates.append(Deadline(call_deadline, "the call's gRPC deadline"))
    if timeout_s is not None:
        seconds = check_timeout(timeout_s)
        candidates.append(Deadline(now + seconds, f"{TIMEOUT_FIELD} of {seconds:g} s", TIMEOUT_FIELD))
    if default_s is not None:
        candidates.append(Deadline(now + default_s, f"the server's --request-timeout of {default_s:g} s"))
    return min(candidates, key=lambda d: d.at, default=None)


def timeout_ms(deadline: float | None, now: float | None = None) -> int:
    """SubmitCommand.timeout_ms for a request due at `deadline`: the milliseconds left, rounded
    up and at least 1 (one already past is dropped by the data plane at once); 0 for none."""
    if deadline is None:
        return 0
    left = deadline - (time.monotonic() if now is None else now)
    return min(MAX_TIMEOUT_MS, max(1, math.ceil(left * 1000)))
