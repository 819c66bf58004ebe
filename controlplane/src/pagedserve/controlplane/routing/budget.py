"""Block-budget accounting for one data plane, as one control-plane replica sees it.

The data plane reports its free blocks (evictable cached blocks included) after every step.
Between admitting a request and the data plane's first report that covers it (its first
token, its end or its rejection), the request's blocks are reserved here so that a burst of
admissions cannot overcommit the pool. Until that report, the reservation and the blocks the
data plane has already allocated for a prefill in progress may both count: the error is on
the safe side and lasts one prefill.
"""

from __future__ import annotations


class BlockBudget:
    def __init__(self) -> None:
        self.total_blocks = 0
        self.reported_free_blocks = 0
        self._reserved: dict[str, int] = {}
        self._reserved_total = 0
        self._tenant: dict[str, str] = {}  # request id -> its tenant, for reservations made with one

    def report(self, free_blocks: int, total_blocks: int) -> None:
        self.reported_free_blocks = free_blocks
        self.total_blocks = total_blocks

    @property
    def reserved_blocks(self) -> int:
        return self._reserved_total

    @property
    def available_blocks(self) -> int:
        return self.reported_free_blocks - self._reserved_total

    def reserve(self, request_id: str, num_blocks: int, tenant: str = "") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if request_id in self._reserved:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        self._reserved[request_id] = num_blocks
        self._reserved_total += num_blocks
        self._tenant[request_id] = tenant

    def release(self, request_id: str) -> int:
        """Drop a reservation (no-op when there is none); returns the blocks released."""
        blocks = self._reserved.pop(request_id, 0)
        self._reserved_total -= blocks
        self._tenant.pop(request_id, None)
        return blocks

    def reserved_by(self, tenant: str) -> tuple[int, int]:
        """`tenant`'s reservations here: how many, and their blocks."""
        mine = [self._reserved[r] for r, t in self._tenant.items() if t == tenant]
        return len(mine), sum(mine)

    def holds(self, request_id: str) -> bool:
        return request_id in self._reserved

    @property
    def num_reserved(self) -> int:
        """Requests placed here that the data plane has not yet reported on: queued there or
        prefilling (a reservation ends at the request's first token, end or rejection)."""
        return len(self._reserved)

    def clear(self) -> None:
        self._reserved.clear()
        self._tenant.clear()
        self._reserved_total = 0
        self.reported_free_blocks = 0
