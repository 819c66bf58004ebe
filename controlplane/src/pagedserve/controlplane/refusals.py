"""Overload without silence: the public gRPC server's options and the refusal log.

grpc-core keeps calls that the application has not yet picked up in a backlog and, past
1,000 of them, drops new ones at random (all of them past 3,000), and drops any still there
after 30 s: the client sees a bare CANCELLED, with no retry hint, no log line and no count.
A burst of a few thousand calls at once overflows it, because grpc.aio picks calls up one
at a time on the event loop. `PUBLIC_SERVER_OPTIONS` switches those drops off, so every call
reaches the servicer, where admission refuses what does not fit with RESOURCE_EXHAUSTED and
a retry-after hint (or DEADLINE_EXCEEDED at the queue timeout). The backlog then waits only
on the event loop, which drains thousands of calls a second, and a call's own deadline
still ends it.

`RefusalLog` logs refusals and failures by reason, at most one line per reason per interval
with the count since the last line, so a burst of 10,000 refusals writes a few lines, not
10,000 (the metric `pagedserve_request_failure_total{code}` counts every one).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from pagedserve.common.clock import SYSTEM_CLOCK, Clock
from pagedserve.common.log import get_logger
from pagedserve.controlplane.errors import ServiceError

log = get_logger(__name__)

_NEVER = 2**31 - 1
PUBLIC_SERVER_OPTIONS = [
    # grpc-core's random early drop of calls waiting to be picked up (soft and hard limit):
    # off; admission is the bound, and it answers with a hint.
    ("grpc.server.max_pending_requests", _NEVER),
    ("grpc.server.max_pending_requests_hard_limit", _NEVER),
    # ... and its drop of calls waiting longer than this (default 30 s): the call's own
    # deadline, or the client, ends such a call with a status it can act on.
    ("grpc.server_max_unrequested_time_in_server", _NEVER),
]

REFUSAL_LOG_INTERVAL_S = 10.0
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")


def refusal_reason(exc: ServiceError) -> str:
    """What refusals of one kind share: the status and the message with its figures taken out
    ("admission queue is full (N requests waiting ...)"). INTERNAL messages name a request
    id, so those are keyed by the status alone."""
    if exc.code == "INTERNAL":
        return exc.code
    return f"{exc.code}: {_NUMBERS.sub('N', exc.message)[:160]}"


@dataclass
class _Reason:
    last_logged: float
    suppressed: int = 0  # refusals since the last line, not yet written
    example: ServiceError | None = None  # the latest of them, for the next line
    request_id: str | None = None


class RefusalLog:
    """One structured line per reason per `interval_s`: the first refusal of a reason is
    logged at once; later ones within the interval are counted, and one line with their
    `count` follows when the interval ends (scheduled on the running event loop; without
    one, the next refusal of that reason writes it). So the log tells how many there were
    without one line each, and a burst's tail is never left unsaid."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S, clock: Clock = SYSTEM_CLOCK) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._reasons: dict[str, _Reason] = {}
        self.lines = 0  # lines written, for tests

    def note(self, exc: ServiceError, request_id: str | None = None) -> None:
        """Record one refusal."""
        key = refusal_reason(exc)
        now = self._clock.monotonic()
        seen = self._reasons.get(key)
        if seen is None or (seen.suppressed == 0 and now - seen.last_logged >= self.interval_s):
            self._reasons[key] = _Reason(now)
            self._write(exc, request_id, 1)
            return
        seen.suppressed += 1
        seen.example, seen.request_id = exc, request_id
        if now - seen.last_logged >= self.interval_s:  # no loop flushed it: this one does
            self.flush(key)
        elif seen.suppressed == 1:
            with contextlib.suppress(RuntimeError):  # no running loop: the next note flushes
                delay = seen.last_logged + self.interval_s - now
                self._clock.call_later(delay, lambda: self.flush(key))

    def flush(self, key: str) -> None:
        """Write the line for the refusals of `key` not logged yet, if any."""
        seen = self._reasons.get(key)
        if seen is None or seen.suppressed == 0 or seen.example is None:
            return
        self._write(seen.example, seen.request_id, seen.suppressed)
        self._reasons[key] = _Reason(self._clock.monotonic())

    def _write(self, exc: ServiceError, request_id: str | None, count: int) -> None:
        self.lines += 1
        log.info(
            "requests_failed" if exc.code == "INTERNAL" else "requests_refused",
            code=exc.code,
            reason=exc.message,
            count=count,  # refusals of this kind this line stands for (the latest one's fields)
            interval_s=self.interval_s,
            retry_after_s=exc.retry_after_s,
            request_id=request_id,
        )
