"""Tenants' fair shares in the scheduler, driven without a model: join order by share,
preemption of a tenant over its share (by swap and by recompute) that resumes the victims with
the tokens an unpreempted run gives, no back-and-forth between two tenants, priorities first,
and no change at all while one tenant is present.

The simulated model step of tests/dataplane/test_scheduler_priorities.py is reused: each token
depends on its own request's tokens so far only.
"""

from __future__ import annotations

import pytest

from pagedserve.dataplane.scheduler import Request, Scheduler
from pagedserve.dataplane.scheduler.fair_share import Shares, several_tenants
from tests.dataplane.test_scheduler_priorities import Clock, alone, drain, make_request, make_scheduler, step


def tenant_request(
    rid: str, tenant: str, prompt_len: int = 4, max_tokens: int = 8, weight: float = 1.0
) -> Request:
    r = make_request(rid, prompt_len, max_tokens)
    r.tenant = tenant
    r.tenant_weight = weight
    return r


def flooded(clock: Clock, n: int = 4, **settings: object) -> tuple[Scheduler, list[Request]]:
    """A batch of `n` seats filled by tenant a's requests (each past its first token)."""
    s = make_scheduler(clock, max_num_seqs=n, num_blocks=64, **settings)  # type: ignore[arg-type]
    flood = [tenant_request(f"a{i}", "a", max_tokens=12) for i in range(n)]
    for r in flood:
        s.add_request(r)
    step(s)
    assert len(s.running) == n
    return s, flood


def first_token_steps(s: Scheduler, clock: Clock, rids: set[str], steps: int = 100) -> dict[str, int]:
    """The step (counted from 1) at which each of `rids` got its first token."""
    seen: dict[str, int] = {}
    for k in range(1, steps + 1):
        out, _ = step(s)
        clock.now += 0.01
        for i in out.scheduled:
            if i.request.request_id in rids and i.request.num_output_tokens >= 1:
                seen.setdefault(i.request.request_id, k)
        if seen.keys() == rids:
            break
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_newcomer_tenant_takes_a_seat_from_a_flooding_one_at_once(mode: str) -> None:
    clock = Clock()
    s, flood = flooded(clock, host_blocks=32 if mode == "swap" else 0, preemption_mode=mode)
    for i in range(4, 8):  # a's flood goes on queueing behind its running requests
        s.add_request(tenant_request(f"a{i}", "a", max_tokens=12))
    b = tenant_request("b0", "b")
    s.add_request(b)
    out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["a3"]  # a's most recently admitted
    assert [i.request.request_id for i in out.scheduled if i.request is b] == ["b0"]
    assert b.num_output_tokens == 1  # its first token in the step it arrived in
    assert s.num_fair_share_preemptions == 1 == s.num_preemptions and s.num_priority_preemptions == 0
    if mode == "swap":
        assert out.swapped_out and s.num_swap_preemptions == 1
    outputs: dict[str, list[int]] = {}
    drain(s, outputs, clock)
    for r in [*flood, b]:  # every one finishes with the tokens of an unpreempted run
        assert outputs[r.request_id] == alone(r.request_id, 4, len(outputs[r.request_id])), r.request_id


def test_seats_split_evenly_and_never_go_back_and_forth() -> None:
    clock = Clock()
    s, _ = flooded(clock, n=6)
    for i in range(6):
        s.add_request(tenant_request(f"b{i}", "b", max_tokens=30))
    out, _ = step(s)
    assert sorted(r.request_id for r in out.preempted) == ["a3", "a4", "a5"]  # 6 seats: 3 and 3
    assert sorted(r.tenant for r in s.running) == ["a"] * 3 + ["b"] * 3
    for _ in range(5):  # the victims wait; equal shares preempt nobody
        out, _ = step(s)
        assert not out.preempted
    assert s.num_fair_share_preemptions == 3


def test_weights_set_the_split() -> None:
    clock = Clock()
    s, _ = flooded(clock, n=6)
    for i in range(6):
        s.add_request(tenant_request(f"b{i}", "b", max_tokens=30, weight=2.0))
    step(s)
    assert sorted(r.tenant for r in s.running) == ["a"] * 2 + ["b"] * 4  # 2/1 against 4/2


def test_join_order_follows_shares_then_arrival() -> None:
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=8, num_blocks=64)
    for i in range(3):
        s.add_request(tenant_request(f"a{i}", "a"))
    step(s)
    s.abort("a0"), s.abort("a1"), s.abort("a2")
    # a holds nothing now, so arrival order holds between equals: a's first, then b's, ...
    for rid, tenant in (("a3", "a"), ("a4", "a"), ("a5", "a"), ("b0", "b"), ("c0", "c"), ("b1", "b")):
        s.add_request(tenant_request(rid, tenant))
    out, _ = step(s)
    # ... and each join goes to the tenant holding least: a3, b0, c0 (one each), a4, b1, a5.
    assert [i.request.request_id for i in out.scheduled] == ["a3", "b0", "c0", "a4", "b1", "a5"]


def test_a_better_priority_is_never_taken_for_a_share() -> None:
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=2, num_blocks=64)
    for rid in ("a0", "a1"):
        r = tenant_request(rid, "a", max_tokens=20)
        r.priority = -5
        s.add_request(r)
    step(s)
    s.add_request(tenant_request("b0", "b"))
    out, _ = step(s)
    assert not out.preempted and [r.request_id for r in s.waiting] == ["b0"]


def test_no_preemption_when_the_victims_a_share_allows_would_not_make_room() -> None:
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=8, num_blocks=16)
    for rid in ("a0", "a1"):  # 1 block each, 2 once they decode
        s.add_request(tenant_request(rid, "a", max_tokens=4))
    s.add_request(tenant_request("a2", "a", prompt_len=20, max_tokens=4))  # 5 blocks, then 6
    s.add_request(tenant_request("bx", "b", max_tokens=8))
    step(s)
    step(s)
    assert s.kv_cache.pool.num_free_blocks == 4
    # b9's prompt takes 11 blocks. b holds 1 of 4 running: a share allows taking a2 only
    # (a: 3 > 2, then 2 > 2 fails), which frees 6: 10 < 11, so nobody is preempted (a1 as
    # well would make room, but would leave a below b).
    s.add_request(tenant_request("b9", "b", prompt_len=44, max_tokens=4))  # (shares no block)
    out, _ = step(s)
    assert not out.preempted and s.num_fair_share_preemptions == 0
    assert [r.request_id for r in s.waiting] == ["b9"]


def test_a_newcomer_joins_in_one_step_behind_a_flood() -> None:
    """The e2e point in small: b's first tokens come at once, not after a's queue."""
    clock = Clock()
    s, _ = flooded(clock, n=8)
    for i in range(8, 40):
        s.add_request(tenant_request(f"a{i}", "a", max_tokens=12))
    for i in range(3):
        s.add_request(tenant_request(f"b{i}", "b"))
    assert first_token_steps(s, clock, {"b0", "b1", "b2"}) == {"b0": 1, "b1": 1, "b2": 1}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_one_tenant_schedules_exactly_as_no_tenant(mode: str) -> None:
    def run(tenant: str) -> list[list[tuple[str, int]]]:
        clock = Clock()
        s = make_scheduler(
            clock, num_blocks=12, host_blocks=16 if mode == "swap" else 0, preemption_mode=mode
        )
        plans = []
        for k in range(60):
            if k < 10:
                s.add_request(tenant_request(f"r{k}", tenant, prompt_len=3 + k % 5, max_tokens=6 + k % 4))
            out, _ = step(s)
            plans.append([(i.request.request_id, i.num_new_tokens) for i in out.scheduled])
            if not s.has_unfinished():
                break
        assert s.num_fair_share_preemptions == 0
        return plans

    assert run("") == run("only-tenant")


def test_several_tenants_and_shares() -> None:
    a, b = tenant_request("a", "t1"), tenant_request("b", "t2", weight=4.0)
    assert not several_tenants([]) and not several_tenants([a]) and several_tenants([a, b])
    shares = Shares([a, b, b])
    assert shares.share(a) == 1.0 and shares.share(b) == 0.5
