"""The scheduler's invariants, asserted: what its queues, block tables and pools must agree on.
No torch. Tests run it after every step; it reads the scheduler and changes nothing."""

from __future__ import annotations

from collections import Counter, deque
from typing import Protocol

from pagedserve.dataplane.kvcache import KVCacheManager, cdiv
from pagedserve.dataplane.request import Request, RequestStatus


class SchedulerState(Protocol):
    """What the check reads of a Scheduler (dataplane/src/pagedserve/dataplane/scheduler/scheduler.py)."""

    kv_cache: KVCacheManager
    running: list[Request]
    waiting: deque[Request]
    swapped: deque[Request]
    requests: dict[str, Request]
    max_num_seqs: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_priority_preemptions: int
    num_fair_share_preemptions: int


def check_integrity(scheduler: SchedulerState) -> None:
    scheduler.kv_cache.check_integrity()
    pool = scheduler.kv_cache.pool
    holders = Counter(b for r in [*scheduler.running, *scheduler.waiting] for b in r.block_table)
    assert len(holders) == pool.num_used_blocks, (
        f"requests hold {len(holders)} blocks but the pool has {pool.num_used_blocks} in use"
    )
    for block_id, n in holders.items():
        assert pool.blocks[block_id].ref_cnt == n, f"{pool.blocks[block_id]} is in {n} block tables"
    for r in scheduler.waiting:
        assert not r.block_table and r.num_computed_tokens == 0, f"waiting {r} holds blocks"
        assert not r.host_block_table, f"waiting {r} holds host blocks"
        assert r.status is RequestStatus.WAITING, f"{r} is in the waiting queue"
    for r in scheduler.running:
        assert not r.host_block_table, f"running {r} holds host blocks"
        assert r.status is RequestStatus.RUNNING, f"{r} is in the running list"
    host = scheduler.kv_cache.host_pool
    host_holders = Counter(b for r in scheduler.swapped for b in r.host_block_table)
    assert len(host_holders) == sum(len(r.host_block_table) for r in scheduler.swapped), (
        "a host block is shared"
    )
    assert len(host_holders) == (0 if host is None else host.num_used_blocks), (
        f"swapped-out requests hold {len(host_holders)} host blocks, the host pool has "
        f"{0 if host is None else host.num_used_blocks} in use"
    )
    for r in scheduler.swapped:
        assert r.status is RequestStatus.SWAPPED, f"{r} is in the swapped queue"
        assert not r.block_table, f"swapped-out {r} holds device blocks"
        assert len(r.host_block_table) == cdiv(r.num_computed_tokens, scheduler.kv_cache.block_size), (
            f"swapped-out {r} holds the wrong number of host blocks"
        )
    queued = [*scheduler.running, *scheduler.waiting, *scheduler.swapped]
    assert len({id(r) for r in queued}) == len(queued), "a request is queued twice"
    assert {r.request_id: r for r in queued} == scheduler.requests, "queues and requests disagree"
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert scheduler.num_preemptions == scheduler.num_swap_preemptions + scheduler.num_recompute_preemptions
    assert (
        scheduler.num_priority_preemptions + scheduler.num_fair_share_preemptions <= scheduler.num_preemptions
    )
    for r in [*scheduler.waiting, *scheduler.swapped]:
        assert r.queued_at is not None, f"queued {r} has no queue time"
    for r in scheduler.running:
        assert r.queued_at is None, f"running {r} still counts queue time"
