"""Tenants' fair shares of the batch in the scheduler. No torch.

Every request carries the tenant the control plane admitted it for (`Request.tenant`, "" when
none was named) and that tenant's weight. While requests of one tenant only are present,
nothing here applies and the scheduler is first come, first served as before. With two or more:

- **Order.** The next request to join (new, recomputing, or swapped out) is, among those of the
  best effective priority, one of the tenant with the fewest running requests per unit of
  weight; within a tenant its own order holds (swapped-out work first, then first come, first
  served). A tenant that flooded the queue therefore no longer sits ahead of a newcomer.
- **Preemption for a share.** When that request lacks a batch slot or blocks, running requests
  of the tenant furthest over its share are preempted for it, the most recently admitted first
  (its least progress), through the usual swap or recompute path, while that tenant, less the
  ones taken, still holds more per unit of weight than the request's tenant would with it
  (`count_T / w_T > (count_B + 1) / w_B`). The strict inequality means two tenants never take
  a slot back and forth: after a preemption the victim's tenant holds at least as much as the
  newcomer's. A running request of a strictly better priority is never taken for a share.

Shares count running requests, i.e. batch slots: that is what a tenant's flood of short
requests takes from another's latency. Blocks follow from it: a preemption for a share is made
only when the victims free enough for the request to join.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from pagedserve.dataplane.request import Request
from pagedserve.dataplane.scheduler.priority import Priorities, varies


def several_tenants(requests: Iterable[Request]) -> bool:
    """Whether the requests belong to more than one tenant (else nothing here applies)."""
    return varies(r.tenant for r in requests)


class Shares:
    """Running requests per tenant during one step's joins, kept current as they change."""

    def __init__(self, running: Iterable[Request]) -> None:
        self.count: Counter[str] = Counter(r.tenant for r in running)

    def share(self, request: Request) -> float:
        """Running requests of `request`'s tenant per unit of its weight."""
        return self.count[request.tenant] / request.tenant_weight

    def joined(self, request: Request) -> None:
        self.count[request.tenant] += 1

    def left(self, request: Request) -> None:
        self.count[request.tenant] -= 1

    def next_to_join(
        self, swapped: Sequence[Request], waiting: Sequence[Request], ranks: Priorities | None
    ) -> Request | None:
        """The best of each tenant's first swapped-out and first waiting request: the best
        effective priority, then the tenant holding least, then swapped-out before waiting,
        then queue order. (A linear scan; the control plane keeps these queues short.)"""
        best: Request | None = None
        best_key: tuple[int, float, int, int] | None = None
        for kind, queue in enumerate((swapped, waiting)):
            seen: set[str] = set()
            for position, request in enumerate(queue):
                if request.tenant in seen:
                    continue
                seen.add(request.tenant)
                rank = 0 if ranks is None else ranks.effective(request)
                key = (rank, self.share(request), kind, position)
                if best_key is None or key < best_key:
                    best, best_key = request, key
        return best

    def victims(self, request: Request, running: Sequence[Request]) -> Iterator[Request]:
        """Running requests to preempt for `request`, in the order to take them: each time the
        most recently admitted one of the tenant furthest over its share, while that tenant
        (less those already taken) holds more per unit of weight than `request`'s tenant would
        with it. Never one of `request`'s tenant or of a strictly better priority."""
        count = Counter(self.count)
        mine = (count[request.tenant] + 1) / request.tenant_weight
        taken: set[int] = set()
        while True:
            victim: Request | None = None
            most = mine
            for r in reversed(running):  # (newest first: ties keep the most recently admitted)
                if id(r) in taken or r.tenant == request.tenant or r.priority < request.priority:
                    continue
                held = count[r.tenant] / r.tenant_weight
                if held > most:
                    victim, most = r, held
            if victim is None:
                return
            taken.add(id(victim))
            count[victim.tenant] -= 1
            yield victim
