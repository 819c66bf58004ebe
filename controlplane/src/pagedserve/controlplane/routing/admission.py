"""Admission: a bounded queue of requests waiting for KV budget, with deadlines.

A request is placed at once when nobody of its priority or better is waiting and some data
plane's budget covers it; otherwise it queues. The next one examined is the best priority
(lower first) and, among equal priorities, the head of the tenant furthest behind its
weighted fair share, FIFO within a tenant: a large request at the head is not starved by
smaller ones behind it, and with one tenant and one priority the queue is a plain FIFO.

Fair share, in tokens over the tenant's weight (a request counts prompt + max_tokens × n):
first of the KV cache held now, then of the tokens served so far. The head of the tenant
whose admitted, unfinished requests hold the least goes next, so a tenant arriving while
another fills the data planes gets the next free room until both hold the same (weighted)
share; between tenants holding the same, the one with the least virtual token counter goes
(as in VTC, Sheng et al. 2024: tokens admitted for it; what a request does not generate is
given back when it ends, `finished`). A tenant that starts waiting is lifted to the counter
of the request served last, so idleness banks no credit. A tenant that floods the queue
only raises its own share: another tenant's requests are served between its own, in
proportion to the weights. Priority stays first: fairness orders only equal priorities.

`poke()` retries the queue whenever budgets change (a data plane reported, a request
finished) and whenever a request leaves it unplaced (deadline, cancel, a client that went
away), so the next one is examined at once rather than at its own deadline. A full queue
refuses with RESOURCE_EXHAUSTED and a retry hint; a request still waiting at its deadline
fails with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pagedserve.common.clock import SYSTEM_CLOCK, Clock
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.tenancy.tenants import DEFAULT_TENANT

T = TypeVar("T")


class HeldBack:
    """A placer's answer: the request's tenant already has enough waiting on the data planes
    with room (its dispatch cap); other tenants' requests may go past it meanwhile."""


HELD_BACK = HeldBack()

Place = Callable[[], T | HeldBack | None]
"""Tries to place the request now: a placement (budget reserved), None if nothing fits, or
HELD_BACK when only its tenant's own dispatch cap holds it."""

_arrivals = itertools.count()


@dataclass
class _Waiter(Generic[T]):
    place: Place[T]
    future: asyncio.Future[T]
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    cost: float = 0.0  # tokens the tenant's counter is charged when it is placed
    hold: str | None = None  # the key its tokens are held under until `finished` (None: not held)
    enqueued: float = 0.0
    seq: int = field(default_factory=lambda: next(_arrivals))

    @property
    def order(self) -> tuple[int, int]:
        return self.priority, self.seq


class AdmissionQueue(Generic[T]):
    def __init__(
        self,
        max_queue_len: int,
        queue_timeout_s: float,
        release: Callable[[T], object],
        weights: Mapping[str, float] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """`release` undoes a placement whose requester was cancelled before it could use it.
        `weights`: each tenant's share (a tenant not named has weight 1)."""
        self._release = release
        self._clock = clock
        self.max_queue_len = max_queue_len
        self.queue_timeout_s = queue_timeout_s
        self.weights = dict(weights or {})
        self._queues: dict[str, list[_Waiter[T]]] = {}  # tenant -> its waiters by (priority, arrival)
        self._size = 0
        self._counters: dict[str, float] = {}  # tenant -> tokens admitted / weight (fair share)
        self._held: dict[str, float] = {}  # tenant -> tokens of its admitted, unfinished requests
        self._holds: dict[str, tuple[str, float]] = {}  # hold key -> (tenant, tokens)
        self._last_served = 0.0  # the counter of the tenant served last, before its charge
        self._mean_wait_s = 1.0  # EWMA of queue time of admitted requests, for retry hints
        self.admitted_tokens: Counter[str] = Counter()  # tenant -> tokens admitted (metrics)
        self.refused: Counter[str] = Counter()  # tenant -> requests refused for a full queue

    def __len__(self) -> int:
        return self._size

    def waiting(self) -> dict[str, int]:
        """Requests waiting, by tenant (metrics)."""
        return {tenant: len(q) for tenant, q in self._queues.items() if q}

    def counter(self, tenant: str) -> float:
        """The tenant's fair-share counter: tokens admitted for it over its weight."""
        return self._counters.get(tenant, 0.0)

    def held(self, tenant: str) -> float:
        """Tokens the tenant's admitted, unfinished requests may take, over its weight."""
        return self._held.get(tenant, 0.0) / self.weights.get(tenant, 1.0)

    def finished(self, hold: str, unused: float = 0.0) -> None:
        """The request admitted under `hold` ended (any way): its tokens are no longer held,
        and the `unused` ones it was charged for but did not generate are given back."""
        tenant, tokens = self._holds.pop(hold, (None, 0.0))
        if tenant is None:
            return
        self._held[tenant] -= tokens
        if self._held[tenant] <= 0:
            del self._held[tenant]
        self._counters[tenant] -= min(unused, tokens) / self.weights.get(tenant, 1.0)

    async def admit(
        self,
        place: Place[T],
        timeout_s: float | None = None,
        priority: int = 0,
        tenant: str = DEFAULT_TENANT,
        cost: float = 0.0,
        hold: str | None = None,
    ) -> tuple[T, float]:
        """A placement and the seconds spent queueing; raises ServiceError when refused.
        `cost`: the tokens the request may take (its tenant's fair share is charged that);
        with a `hold` key they count as its tenant's until `finished(hold)`."""
        best = self._best_priority()
        if best is None or priority < best:
            placed = place()
            if placed is not None and not isinstance(placed, HeldBack):
                if not self._queues.get(tenant):
                    self._lift(tenant)
                self._charge(tenant, cost, hold)
                return placed, 0.0
        if self._size >= self.max_queue_len:
            self.refused[tenant] += 1
            hint = max(1.0, round(self._mean_wait_s * (1 + self._size / max(1, self.max_queue_len)), 1))
            raise ServiceError(
                "RESOURCE_EXHAUSTED",
                f"admission queue is full ({self.max_queue_len} requests waiting for KV blocks); retry in ~{hint:g}s",
                retry_after_s=hint,
            )
        future = asyncio.get_running_loop().create_future()
        waiter: _Waiter[T] = _Waiter(place, future, priority, tenant, cost, hold, self._clock.monotonic())
        queue = self._queues.setdefault(tenant, [])
        first = not queue
        if first:
            self._lift(tenant)
        bisect.insort(queue, waiter, key=lambda w: w.order)  # behind its priority or better
        self._size += 1
        if first and best is not None:
            self.poke()  # its tenant's new head may go where the heads before it are held back
        limit = self.queue_timeout_s if timeout_s is None else min(timeout_s, self.queue_timeout_s)
        admitted = False
        try:
            async with self._clock.timeout(max(0.0, limit)):
                await asyncio.shield(waiter.future)
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
        waited = self._clock.monotonic() - waiter.enqueued
        self._mean_wait_s = 0.8 * self._mean_wait_s + 0.2 * waited
        return placed, waited

    def poke(self) -> None:
        """Place waiting requests, in order, while they fit; a tenant whose head is held back
        by its own dispatch cap is passed over until the next poke."""
        held: set[str] = set()
        while True:
            head = self._head(held)
            if head is None:
                return
            if head.future.done():  # cancelled or timed out
                self._remove(head)
                continue
            try:
                placed = head.place()
            except ServiceError as exc:  # e.g. no data plane can ever take it any more
                self._remove(head)
                head.future.set_exception(exc)
                continue
            if placed is None:
                return
            if isinstance(placed, HeldBack):
                held.add(head.tenant)
                continue
            self._remove(head)
            self._charge(head.tenant, head.cost, head.hold)
            head.future.set_result(placed)

    def fail_all(self, error: ServiceError) -> None:
        for queue in self._queues.values():
            for waiter in queue:
                if not waiter.future.done():
                    waiter.future.set_exception(error)
            queue.clear()
        self._size = 0

    # -- the order ------------------------------------------------------------------------------
    def _best_priority(self) -> int | None:
        return min((q[0].priority for q in self._queues.values() if q), default=None)

    def _head(self, passed: frozenset[str] | set[str] = frozenset()) -> _Waiter[T] | None:
        """The next to examine, of tenants not `passed`: best priority; then the tenant holding
        the least now, then the one served least so far (both in tokens over its weight);
        then the earliest."""
        heads = [q[0] for t, q in self._queues.items() if q and t not in passed]
        if not heads:
            return None
        return min(heads, key=lambda w: (w.priority, self.held(w.tenant), self.counter(w.tenant), w.seq))

    def _lift(self, tenant: str) -> None:
        """A tenant that was not waiting starts no further back than the request served last
        (start-time fair queueing's virtual time): time spent idle is no credit to spend later
        in a burst, and it is at most one request ahead of the tenants already waiting."""
        self._counters[tenant] = max(self.counter(tenant), self._last_served)

    def _charge(self, tenant: str, cost: float, hold: str | None) -> None:
        self._last_served = max(self._last_served, self.counter(tenant))
        self._counters[tenant] = self.counter(tenant) + cost / self.weights.get(tenant, 1.0)
        self.admitted_tokens[tenant] += int(cost)
        if hold is not None and cost > 0 and hold not in self._holds:
            self._holds[hold] = (tenant, cost)
            self._held[tenant] = self._held.get(tenant, 0.0) + cost

    def _remove(self, waiter: _Waiter[T]) -> None:
        queue = self._queues.get(waiter.tenant, [])
        at = bisect.bisect_left(queue, waiter.order, key=lambda w: w.order)
        if at < len(queue) and queue[at] is waiter:
            del queue[at]
            self._size -= 1
