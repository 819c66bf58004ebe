"""The client's retry policy (docs/api.md, "Retries"): when a failed call is tried again."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class RetryPolicy:
    """The retry policy of docs/api.md ("Retries"), the same in the Go, Java and Python clients.

    - UNAVAILABLE is retried only while the call has received no response message (for
      Generate: before the first token), after an exponential backoff
      `min(initial_backoff_s * multiplier ** (retry - 1), max_backoff_s)`, less up to `jitter`
      of it at random.
    - RESOURCE_EXHAUSTED is retried only when the server sent a `retry-after` trailer (seconds),
      after exactly that long, and only if that is at most `max_retry_after_s`.
    - Nothing else is retried, and never once a response has arrived.
    - At most `max_attempts` calls in all; a retry whose wait would pass the deadline (the
      client's `timeout`, which covers all attempts) is not made.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_retry_after_s: float = 30.0

    def delay(
        self,
        retry: int,
        started: bool,
        code: grpc.StatusCode | None,
        trailers: Iterable[tuple[str, str | bytes]] | None = None,
    ) -> float | None:
        """Seconds to wait before retry number `retry` (1 for the first) after a failure with
        `code` and `trailers`, or None when it must not be retried. `started`: whether the
        failed attempt had received a response message."""
        if started or retry >= self.max_attempts:
            return None
        if code == grpc.StatusCode.UNAVAILABLE:
            backoff = min(self.initial_backoff_s * self.multiplier ** (retry - 1), self.max_backoff_s)
            return backoff * (1 - self.jitter * random.random())
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            value = dict(trailers or ()).get("retry-after")
            try:
                seconds = float(value.decode() if isinstance(value, bytes) else value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return None
            return seconds if 0 <= seconds <= self.max_retry_after_s else None
        return None


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _wait(
    policy: RetryPolicy, retry: int, started: bool, exc: grpc.RpcError, deadline: float | None
) -> float | None:
    """The policy's wait before the next attempt, or None when `exc` must be raised."""
    code = exc.code() if hasattr(exc, "code") else None
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    wait = policy.delay(retry, started, code, trailers)
    if wait is None or (deadline is not None and time.monotonic() + wait >= deadline):
        return None
    return wait
