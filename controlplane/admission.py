"""Admission: a bounded queue of requests waiting for KV budget, with deadlines. No torch.

A request is placed at once when nobody of its priority or better is waiting and some data
plane's budget covers it; otherwise it queues, ordered by priority (lower first) and then
first come, first served: a large request at the head is not starved by smaller ones behind
it, and with one priority for all the queue is a plain FIFO. `poke()` retries the queue whenever budgets change (a data plane
reported, a request finished) and whenever a request leaves it unplaced (deadline, cancel, a
client that went away), so the next one is examined at once rather than at its own deadline.
A full queue refuses with RESOURCE_EXHAUSTED and a retry hint; a request still waiting at its
deadline fails with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pagedserve.controlplane.errors import ServiceError

T = TypeVar("T")

Place = Callable[[], T | None]
"""Tries to place the request now: a placement (budget reserved), or None if nothing fits."""


@dataclass
class _Waiter(Generic[T]):
    place: Place[T]
    future: asyncio.Future[T]
    priority: int = 0
    enqueued: float = field(default_factory=time.monotonic)


class AdmissionQueue(Generic[T]):
    def __init__(self, max_queue_len: int, queue_timeout_s: float, release: Callable[[T], None]) -> None:
        """`release` undoes a placement whose requester was cancelled before it could use it."""
        self._release = release
        self.max_queue_len = max_queue_len
        self.queue_timeout_s = queue_timeout_s
        self._waiting: deque[_Waiter[T]] = deque()
        self._mean_wait_s = 1.0  # EWMA of queue time of admitted requests, for retry hints

    def __len__(self) -> int:
        return len(self._waiting)

    async def admit(
        self, place: Place[T], timeout_s: float | None = None, priority: int = 0
    ) -> tuple[T, float]:
        """A placement and the seconds spent queueing; raises ServiceError when refused."""
        if not self._waiting or priority < self._waiting[0].priority:
            placed = place()
            if placed is not None:
                return placed, 0.0
        if len(self._waiting) >= self.max_queue_len:
            hint = max(
                1.0, round(self._mean_wait_s * (1 + len(self._waiting) / max(1, self.max_queue_len)), 1)
            )
            raise ServiceError(
                "RESOURCE_EXHAUSTED",
                f"admission queue is full ({self.max_queue_len} requests waiting for KV blocks); retry in ~{hint:g}s",
                retry_after_s=hint,
            )
        waiter: _Waiter[T] = _Waiter(place, asyncio.get_running_loop().create_future(), priority)
        # Behind every waiter of its priority or better (a plain append when all are equal).
        at = len(self._waiting)
        while at and self._waiting[at - 1].priority > priority:
            at -= 1
        self._waiting.insert(at, waiter)
        limit = self.queue_timeout_s if timeout_s is None else min(timeout_s, self.queue_timeout_s)
        admitted = False
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(0.0, limit))
            admitted = True
        except TimeoutError:
            if not (waiter.future.done() and not waiter.future.cancelled()):
                raise ServiceError(
                    "DEADLINE_EXCEEDED", f"no data plane had KV blocks for this request within {limit:.1f}s"
                ) from None
            admitted = True  # placed in the same instant the wait timed out: take it
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
                self._remove(waiter)
                self.poke()  # it may have held up the head of the queue: re-examine the rest
            elif not admitted and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(waiter.future.result())  # placed, but the caller went away
        placed = waiter.future.result()
        waited = time.monotonic() - waiter.enqueued
        self._mean_wait_s = 0.8 * self._mean_wait_s + 0.2 * waited
        return placed, waited

    def poke(self) -> None:
        """Place waiting requests, in order, while they fit."""
        while self._waiting:
            head = self._waiting[0]
            if head.future.done():  # cancelled or timed out
                self._waiting.popleft()
                continue
            try:
                placed = head.place()
            except ServiceError as exc:  # e.g. no data plane can ever take it any more
                self._waiting.popleft()
                head.future.set_exception(exc)
                continue
            if placed is None:
                return
            self._waiting.popleft()
            head.future.set_result(placed)

    def fail_all(self, error: ServiceError) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _remove(self, waiter: _Waiter[T]) -> None:
        with contextlib.suppress(ValueError):
            self._waiting.remove(waiter)
