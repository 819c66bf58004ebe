"""Priorities in the scheduler: effective priority with aging, queue order, victims. No torch.

A request's `priority` (lower = earlier, vLLM's semantics) orders the running list, the
swapped queue and the waiting queue, ties kept in their existing order (the stable sort keeps
first come, first served, and recompute victims at the head). When every request has the same
priority nothing is reordered and no request preempts another for priority: the scheduler then
behaves exactly as it does without priorities.

Aging, the starvation guard: a request's effective priority is its priority less one per
`aging_s` seconds it has spent queued (waiting or swapped out; time running does not count),
so a request of priority 10 that has waited 10 intervals ranks with a priority-0 one that just
arrived, and an endless stream of better-priority arrivals cannot hold it back for ever. While
a request runs, its effective priority stays what it was when it joined the batch.

Priority preemption: when the next request to join (the better of the waiting and swapped
heads) cannot get its blocks or a batch slot, running requests whose priority *and* effective
priority are both strictly worse are preempted, worst first, through the ordinary preemption
path (swap or recompute, as `preemption_mode` says), until it fits. Requiring both means aging
only lifts a request in the queue: an aged low-priority request is not preempted by a new
arrival of its own effective rank, and it never preempts a better-priority running one.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, MutableSequence

from pagedserve.dataplane.kvcache import KVCacheManager
from pagedserve.dataplane.request import Request, RequestStatus

PRIORITY_AGING_S = 1.0
"""Seconds of queueing that improve a request's effective priority by one (0: no aging)."""


class Priorities:
    """Effective priorities at one instant, `now` (a `time.monotonic()` value)."""

    def __init__(self, aging_s: float, now: float) -> None:
        if not (aging_s >= 0 and math.isfinite(aging_s)):
            raise ValueError(f"priority aging must be a finite number of seconds >= 0, got {aging_s}")
        self.aging_s = aging_s
        self.now = now

    def queued_s(self, request: Request) -> float:
        """Seconds `request` has spent queued (waiting or swapped out), this stint included."""
        stint = 0.0 if request.queued_at is None else max(0.0, self.now - request.queued_at)
        return request.waited_s + stint

    def effective(self, request: Request) -> int:
        """`request`'s priority less one per `aging_s` seconds queued."""
        if not self.aging_s:
            return request.priority
        return request.priority - math.floor(self.queued_s(request) / self.aging_s)

    def outranks(self, request: Request, victim: Request) -> bool:
        """Whether `request` may preempt the running `victim`: both its priority and its
        effective priority are strictly better (lower)."""
        return request.priority < victim.priority and self.effective(request) < self.effective(victim)

    def victims(self, request: Request, running: list[Request]) -> list[Request]:
        """The running requests `request` outranks, worst effective priority first and, among
        equals, the most recently admitted first (the plain preemption order)."""
        position = {id(r): i for i, r in enumerate(running)}
        return sorted(
            (r for r in running if self.outranks(request, r)),
            key=lambda r: (self.effective(r), position[id(r)]),
            reverse=True,
        )

    def order(self, queue: MutableSequence[Request]) -> None:
        """Sort `queue` in place by effective priority, keeping the order of equals."""
        ranked = sorted(queue, key=self.effective)
        if any(a is not b for a, b in zip(ranked, queue, strict=True)):
            queue.clear()  # (in place: a deque takes no slice assignment)
            queue.extend(ranked)


def varies(values: Iterable[Hashable]) -> bool:
    """Whether `values` holds two different ones (stops at the first that differs)."""
    iterator = iter(values)
    first = next(iterator, None)
    return any(v != first for v in iterator)


def mixed(requests: Iterable[Request]) -> bool:
    """Whether the requests have more than one priority (else nothing is reordered)."""
    return varies(r.priority for r in requests)


def enqueue(request: Request, now: float) -> None:
    """Note that `request` (re)enters a queue at `now`: its queued time runs again."""
    request.queued_at = now


def dequeue(request: Request, now: float) -> None:
    """Note that `request` leaves its queue for the batch at `now`: its queued time stops."""
    if request.queued_at is not None:
        request.waited_s += max(0.0, now - request.queued_at)
    request.queued_at = None


def blocks_to_join(kv_cache: KVCacheManager, request: Request, budget: int) -> int:
    """Free device blocks the queued `request` would take to join now with up to `budget` of
    its tokens (a swapped-out one counted without prefix-cache hits: at most what it takes)."""
    if request.status is RequestStatus.SWAPPED:
        num_new = min(request.compute_end - request.num_computed_tokens, budget)
        return kv_cache.num_blocks_for(request.num_computed_tokens + num_new)
    hits, num_hit_tokens = kv_cache.get_computed_blocks(request)
    num_new = min(request.compute_end - num_hit_tokens, budget)
    evictable = sum(1 for b in hits if kv_cache.pool.blocks[b].ref_cnt == 0)
    return kv_cache.num_blocks_for(num_hit_tokens + num_new) - len(hits) + evictable


def sole_blocks(kv_cache: KVCacheManager, request: Request) -> int:
    """Device blocks only the running `request` holds: what preempting it frees for certain."""
    blocks = kv_cache.pool.blocks
    return sum(1 for b in request.block_table if blocks[b].ref_cnt == 1)
