"""Admission queue: FIFO placement as budgets change, bounded length, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.routing.admission import AdmissionQueue
from pagedserve.controlplane.routing.budget import BlockBudget
from tests.clock import FakeClock


class Pool:
    """A fake data plane budget: place() reserves `need` blocks if they fit."""

    def __init__(self, free: int) -> None:
        self.budget = BlockBudget()
        self.budget.report(free, free)

    def placer(self, rid: str, need: int):  # type: ignore[no-untyped-def]
        def place() -> str | None:
            if self.budget.available_blocks < need:
                return None
            self.budget.reserve(rid, need)
            return rid

        return place


async def until_waiting(q: AdmissionQueue[str], n: int, turns: int = 1000) -> None:
    """Let the event loop run until exactly `n` requests wait in `q` (or fail)."""
    for _ in range(turns):
        if len(q) == n:
            return
        await asyncio.sleep(0)  # one turn of the event loop, no time
    raise AssertionError(f"{len(q)} requests waiting, expected {n}")


def make_queue(
    pool: Pool, max_len: int = 4, timeout: float = 5.0, clock: FakeClock | None = None
) -> AdmissionQueue[str]:
    return AdmissionQueue(max_len, timeout, release=pool.budget.release, clock=clock or FakeClock())


def test_placed_at_once_when_it_fits() -> None:
    async def run() -> None:
        pool = Pool(10)
        q = make_queue(pool)
        assert await q.admit(pool.placer("a", 4)) == ("a", 0.0)
        assert pool.budget.available_blocks == 6

    asyncio.run(run())


def test_waiters_are_placed_in_order_when_blocks_free_up() -> None:
    async def run() -> None:
        pool = Pool(4)
        q = make_queue(pool)
        await q.admit(pool.placer("a", 4))
        big = asyncio.create_task(q.admit(pool.placer("big", 4)))
        small = asyncio.create_task(q.admit(pool.placer("small", 1)))
        await until_waiting(q, 2)
        assert len(q) == 2 and not big.done() and not small.done()
        pool.budget.release("a")
        q.poke()
        assert (await big)[0] == "big"
        assert not small.done()  # FIFO: the small one does not jump the queue
        pool.budget.release("big")
        q.poke()
        assert (await small)[0] == "small"

    asyncio.run(run())


def test_full_queue_is_resource_exhausted_with_a_retry_hint() -> None:
    async def run() -> None:
        pool = Pool(1)
        q = make_queue(pool, max_len=1)
        await q.admit(pool.placer("a", 1))
        waiting = asyncio.create_task(q.admit(pool.placer("b", 1)))
        await until_waiting(q, 1)
        with pytest.raises(ServiceError) as err:
            await q.admit(pool.placer("c", 1))
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert err.value.retry_after_s is not None and err.value.retry_after_s >= 1
        assert "queue is full" in err.value.message
        waiting.cancel()

    asyncio.run(run())


def test_deadline_while_queued() -> None:
    async def run() -> None:
        pool = Pool(1)
        clock = FakeClock()
        q = make_queue(pool, clock=clock)
        await q.admit(pool.placer("a", 1))
        task = asyncio.create_task(q.admit(pool.placer("b", 1), timeout_s=0.5))
        await until_waiting(q, 1)
        clock.advance(0.4)
        await asyncio.sleep(0)
        assert not task.done() and len(q) == 1  # still within its deadline
        clock.advance(0.1)
        with pytest.raises(ServiceError) as err:
            await task
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert err.value.message == "no data plane had KV blocks for this request within 0.5s"
        assert len(q) == 0

    asyncio.run(run())


def test_the_queue_timeout_bounds_a_longer_request_timeout_and_waits_are_measured() -> None:
    async def run() -> None:
        pool = Pool(1)
        clock = FakeClock()
        q = make_queue(pool, timeout=2.0, clock=clock)
        await q.admit(pool.placer("a", 1))
        late = asyncio.create_task(q.admit(pool.placer("late", 1), timeout_s=30.0))
        await until_waiting(q, 1)
        clock.advance(2.0)
        with pytest.raises(ServiceError, match=r"within 2\.0s"):
            await late
        placed = asyncio.create_task(q.admit(pool.placer("b", 1)))
        await until_waiting(q, 1)
        clock.advance(0.75)
        pool.budget.release("a")
        q.poke()
        assert await placed == ("b", 0.75)

    asyncio.run(run())


def test_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    async def run() -> None:
        pool = Pool(1)
        q = make_queue(pool)
        await q.admit(pool.placer("a", 1))
        task = asyncio.create_task(q.admit(pool.placer("b", 1)))
        await until_waiting(q, 1)
        task.cancel()
        await until_waiting(q, 0)  # the cancelled waiter leaves the queue
        assert len(q) == 0
        pool.budget.release("a")
        q.poke()
        assert pool.budget.reserved_blocks == 0

    asyncio.run(run())


def test_a_placement_is_never_orphaned_by_a_cancel() -> None:
    async def run() -> None:
        pool = Pool(1)
        q = make_queue(pool)
        await q.admit(pool.placer("a", 1))
        task = asyncio.create_task(q.admit(pool.placer("b", 1)))
        await until_waiting(q, 1)
        pool.budget.release("a")
        q.poke()  # places "b" (reserving its block) ...
        task.cancel()  # ... and its caller is cancelled before it resumes
        try:
            placed = await task
        except asyncio.CancelledError:
            assert pool.budget.reserved_blocks == 0  # released on the way out
        else:
            assert placed[0] == "b" and pool.budget.holds("b")  # the caller got it and owns it

    asyncio.run(run())


def test_a_placement_error_fails_the_waiter() -> None:
    async def run() -> None:
        pool = Pool(0)
        q = make_queue(pool)
        calls = 0

        def place() -> str | None:
            nonlocal calls
            calls += 1
            if calls == 1:
                return None
            raise ServiceError("UNAVAILABLE", "no data plane")

        task = asyncio.create_task(q.admit(place))
        await until_waiting(q, 1)
        q.poke()
        with pytest.raises(ServiceError, match="no data plane"):
            await task

    asyncio.run(run())


# -- a request leaving the queue wakes it (issue 12) ------------------------------------------


async def _leaves_then_next_is_placed(leave: str) -> float:
    """A big request at the head blocks a small one that fits (FIFO); when the big one leaves
    (`leave`: its deadline passes, or its caller is cancelled), the small one must be placed
    at once, not at its own deadline. Returns how long the small one waited."""
    pool = Pool(10)
    clock = FakeClock()
    q = make_queue(pool, timeout=30.0, clock=clock)
    await q.admit(pool.placer("running", 6))  # 4 blocks left
    big = asyncio.create_task(q.admit(pool.placer("big", 8), timeout_s=0.25 if leave == "deadline" else None))
    await until_waiting(q, 1)
    small = asyncio.create_task(q.admit(pool.placer("small", 2)))
    await until_waiting(q, 2)
    clock.advance(0.25)  # the big one's deadline, if it has one
    if leave == "cancel":
        big.cancel()
    await until_waiting(q, 0)  # nothing else ever pokes the queue, and no more time passes
    placed, waited = await small
    assert placed == "small" and pool.budget.holds("small") and not pool.budget.holds("big")
    with pytest.raises((ServiceError, asyncio.CancelledError)):
        await big
    return waited


@pytest.mark.parametrize("leave", ["deadline", "cancel"])
def test_a_request_leaving_the_queue_wakes_it_so_the_next_is_placed_at_once(leave: str) -> None:
    # Placed the instant the big one left, not at its own deadline (30 s).
    assert asyncio.run(_leaves_then_next_is_placed(leave)) == 0.25


def test_the_head_refused_while_queued_is_skipped_for_the_next() -> None:
    async def run() -> None:
        pool = Pool(4)
        q = make_queue(pool)
        await q.admit(pool.placer("a", 4))
        refuse = False

        def head() -> str | None:
            if refuse:
                raise ServiceError("INVALID_ARGUMENT", "can never fit any more")
            return None

        first = asyncio.create_task(q.admit(head))
        await until_waiting(q, 1)
        second = asyncio.create_task(q.admit(pool.placer("b", 1)))
        await until_waiting(q, 2)
        refuse = True
        pool.budget.release("a")
        q.poke()
        with pytest.raises(ServiceError, match="never fit"):
            await first
        assert (await second)[0] == "b"

    asyncio.run(run())
