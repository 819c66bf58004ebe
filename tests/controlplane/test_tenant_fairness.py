"""The admission queue's weighted fair share among tenants: a tenant flooding the queue cannot
starve another, a tenant holding nothing gets the next room, weights set the proportions,
priority still comes first, idle time banks no credit, and what a request did not generate
is given back."""

from __future__ import annotations

import asyncio

from pagedserve.controlplane.routing.admission import HELD_BACK, AdmissionQueue, HeldBack
from tests.controlplane.test_admission import Pool, until_waiting

COST = 100  # tokens per request (prompt + max_tokens × n)


class Served:
    """A pool that fits one request at a time; `step()` ends the one placed and places the next."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.pool = Pool(1)
        self.q: AdmissionQueue[str] = AdmissionQueue(1000, 30.0, self.release, weights)
        self.order: list[str] = []
        self.tasks: list[asyncio.Task[tuple[str, float]]] = []

    def release(self, rid: str) -> None:
        self.pool.budget.release(rid)

    async def hold(self, rid: str = "holder", tenant: str = "a") -> None:
        await self.q.admit(self.pool.placer(rid, 1), tenant=tenant, cost=COST, hold=rid)
        self.order.append(rid)

    def send(self, rid: str, tenant: str, priority: int = 0) -> None:
        async def one() -> tuple[str, float]:
            place = self.pool.placer(rid, 1)
            placed = await self.q.admit(place, priority=priority, tenant=tenant, cost=COST, hold=rid)
            self.order.append(rid)
            return placed

        self.tasks.append(asyncio.create_task(one()))

    async def step(self) -> None:
        """The request placed last ends: its blocks and its held tokens come back."""
        self.pool.budget.release(self.order[-1])
        self.q.finished(self.order[-1])
        self.q.poke()
        for _ in range(5):
            await asyncio.sleep(0)

    async def drain(self) -> list[str]:
        while len(self.q):
            await self.step()
        await asyncio.gather(*self.tasks)
        return self.order


def test_a_flooding_tenant_cannot_starve_another() -> None:
    async def run() -> None:
        s = Served()
        await s.hold()
        for i in range(50):
            s.send(f"a{i}", "a")
        await until_waiting(s.q, 50)
        for i in range(5):
            s.send(f"b{i}", "b")
        await until_waiting(s.q, 55)
        assert s.q.waiting() == {"a": 50, "b": 5}
        order = await s.drain()
        # b arrived behind 50 of a's, yet its requests alternate with a's from then on.
        assert order[1:11] == ["b0", "a0", "b1", "a1", "b2", "a2", "b3", "a3", "b4", "a4"]
        assert order[11:] == [f"a{i}" for i in range(5, 50)]  # FIFO within a tenant

    asyncio.run(run())


def test_a_tenant_holding_nothing_gets_the_room_that_frees_up() -> None:
    async def run() -> None:
        pool = Pool(4)
        q: AdmissionQueue[str] = AdmissionQueue(100, 30.0, pool.budget.release)
        for i in range(4):  # a fills the data plane
            await q.admit(pool.placer(f"run{i}", 1), tenant="a", cost=COST, hold=f"run{i}")
        order: list[str] = []

        async def one(rid: str, tenant: str) -> None:
            await q.admit(pool.placer(rid, 1), tenant=tenant, cost=COST, hold=rid)
            order.append(rid)

        tasks = [asyncio.create_task(one(f"a{i}", "a")) for i in range(6)]
        await until_waiting(q, 6)
        tasks += [asyncio.create_task(one(f"b{i}", "b")) for i in range(3)]
        await until_waiting(q, 9)
        for rid in ("run0", "run1", "run2", "run3"):  # a's running requests end one by one
            pool.budget.release(rid)
            q.finished(rid)
            q.poke()
            for _ in range(5):
                await asyncio.sleep(0)
        # b held nothing while a held 4: b takes the first rooms until both hold 2, then
        # whoever holds less goes.
        assert order == ["b0", "b1", "a0", "a1"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_weights_set_the_proportions() -> None:
    async def run() -> None:
        s = Served({"a": 3.0, "b": 1.0})
        await s.hold(tenant="c")
        for i in range(20):
            s.send(f"a{i}", "a")
            s.send(f"b{i}", "b")
        await until_waiting(s.q, 40)
        order = await s.drain()
        first = order[1:17]
        assert sum(r.startswith("a") for r in first) == 12  # 3 : 1
        assert sum(r.startswith("b") for r in first) == 4

    asyncio.run(run())


def test_priority_comes_before_the_fair_share() -> None:
    async def run() -> None:
        s = Served()
        await s.hold()
        for i in range(6):
            s.send(f"a{i}", "a", priority=0)  # the flooder's requests are the urgent ones
        for i in range(3):
            s.send(f"b{i}", "b", priority=1)
        s.send("c0", "c", priority=-1)  # a third tenant's more urgent still
        await until_waiting(s.q, 10)
        order = await s.drain()
        assert order[1:] == ["c0", "a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1", "b2"]

    asyncio.run(run())


def test_an_idle_tenant_banks_no_credit() -> None:
    async def run() -> None:
        s = Served()
        for i in range(10):  # a runs alone, each placed at once: its counter grows
            await s.hold(f"alone{i}", "a")
            s.pool.budget.release(f"alone{i}")
            s.q.finished(f"alone{i}")
        assert s.q.counter("a") == 10 * COST and s.q.counter("b") == 0 and s.q.held("a") == 0
        await s.hold("h", "a")
        for i in range(4):
            s.send(f"b{i}", "b")
            s.send(f"a{i}", "a")
        await until_waiting(s.q, 8)
        order = await s.drain()
        # b was idle, not owed: it does not get its next 4 in a row, the two alternate.
        assert order[-8:] == ["b0", "a0", "b1", "a1", "b2", "a2", "b3", "a3"]

    asyncio.run(run())


def test_held_tokens_and_unused_ones_come_back_when_a_request_ends() -> None:
    async def run() -> None:
        s = Served({"a": 2.0})
        await s.hold("x", "a")
        assert s.q.counter("a") == COST / 2 and s.q.held("a") == COST / 2
        assert s.q.admitted_tokens["a"] == COST
        s.q.finished("x", unused=60)  # it generated 60 tokens fewer than max_tokens allowed
        assert s.q.counter("a") == (COST - 60) / 2 and s.q.held("a") == 0
        s.q.finished("x", unused=60)  # twice, or never admitted: nothing more to give back
        s.q.finished("never-admitted")
        assert s.q.counter("a") == (COST - 60) / 2

    asyncio.run(run())


def test_one_tenant_without_costs_is_first_come_first_served() -> None:
    async def run() -> None:
        pool = Pool(1)
        q: AdmissionQueue[str] = AdmissionQueue(10, 5.0, lambda rid: None)
        await q.admit(pool.placer("h", 1))
        tasks = [asyncio.create_task(q.admit(pool.placer(f"r{i}", 1))) for i in range(4)]
        await until_waiting(q, 4)
        placed = []
        for i, task in enumerate(tasks):
            pool.budget.release("h" if i == 0 else f"r{i - 1}")
            q.poke()
            placed.append((await task)[0])
        assert placed == ["r0", "r1", "r2", "r3"]

    asyncio.run(run())


def test_a_tenant_held_back_by_its_own_dispatch_cap_does_not_hold_up_another() -> None:
    async def run() -> None:
        pool = Pool(100)
        q: AdmissionQueue[str] = AdmissionQueue(1000, 30.0, pool.budget.release)
        capped = {"a": True}

        def placer(rid: str, tenant: str):  # type: ignore[no-untyped-def]
            def place() -> str | HeldBack:
                if capped.get(tenant):
                    return HELD_BACK  # its fill already waits on the data plane
                pool.budget.reserve(rid, 1)
                return rid

            return place

        held = asyncio.create_task(q.admit(placer("a1", "a"), tenant="a", cost=COST, hold="a1"))
        await until_waiting(q, 1)
        # b's request queues behind a's head (same priority), then goes past it at once.
        placed, _ = await asyncio.wait_for(q.admit(placer("b1", "b"), tenant="b", cost=COST), 5.0)
        assert placed == "b1" and len(q) == 1 and not held.done()
        capped["a"] = False
        q.poke()
        assert (await asyncio.wait_for(held, 5.0))[0] == "a1"
        assert pool.budget.holds("a1") and pool.budget.holds("b1")

    asyncio.run(run())
