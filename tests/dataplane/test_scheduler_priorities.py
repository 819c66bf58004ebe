"""Priorities in the scheduler, driven without a model: queue order, aging, priority preemption
(by swap and by recompute) that frees the victims' blocks and resumes them with the tokens an
unpreempted run gives, and no change at all while every request has the same priority.

A model step is simulated: each request that samples gets a token that depends on its own
tokens so far only, so a request preempted and resumed (or recomputed) must produce exactly
the tokens it would have produced alone.
"""

from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.scheduler import (
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from pagedserve.dataplane.scheduler.priority import Priorities, mixed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    clock: Clock,
    num_blocks: int = 16,
    host_blocks: int = 0,
    max_num_seqs: int = 8,
    preemption_mode: str = "recompute",
    aging_s: float = 1.0,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), 4, host_pool=BlockPool(host_blocks) if host_blocks else None)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, preemption_mode=preemption_mode, watermark=0.0
    )
    return Scheduler(kv, config, 256, priority_aging_s=aging_s, clock=clock)


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [10 + (sum(map(ord, rid)) + 7 * i) % 50 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, priority=priority)


def next_token(request: Request) -> int:
    """The simulated model: a function of the request's own tokens so far."""
    return 3 + (sum(request.all_token_ids) * 31 + request.num_tokens) % 97


def step(s: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    sampled = {i.request.request_id: next_token(i.request) for i in out.scheduled if i.samples}
    finished = s.update_from_output(out, sampled)
    s.check_integrity()
    return out, finished


def drain(s: Scheduler, outputs: dict[str, list[int]], clock: Clock | None = None) -> None:
    for _ in range(1000):
        if not s.has_unfinished():
            break
        _, finished = step(s)
        outputs.update({r.request_id: r.output_token_ids for r in finished})
        if clock is not None:
            clock.now += 0.01
    assert not s.has_unfinished()
    pool = s.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0
    host = s.kv_cache.host_pool
    assert host is None or host.num_free_blocks == host.num_blocks


def alone(rid: str, prompt_len: int, max_tokens: int) -> list[int]:
    """The request's tokens when it runs by itself (never preempted)."""
    s = make_scheduler(Clock(), num_blocks=64)
    s.add_request(make_request(rid, prompt_len, max_tokens))
    outputs: dict[str, list[int]] = {}
    drain(s, outputs)
    return outputs[rid]


def join_order(requests: list[Request], **settings: object) -> list[str]:
    """The order in which requests join a one-seat batch behind a running blocker."""
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=1, **settings)  # type: ignore[arg-type]
    s.add_request(make_request("blocker", 4, 2, priority=-100))
    step(s)
    for r in requests:
        s.add_request(r)
    order: list[str] = []
    for _ in range(200):
        if not s.has_unfinished():
            break
        out, _ = step(s)
        order += [i.request.request_id for i in out.scheduled if i.request.num_output_tokens <= 1]
    return [rid for i, rid in enumerate(order) if rid not in order[:i] and rid != "blocker"]


# -- order and aging -------------------------------------------------------------------------


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    requests = [make_request(rid, 4, 2, p) for rid, p in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0))]
    assert join_order(requests, aging_s=0.0) == ["d", "b", "e", "a", "c"]


def test_aging_lifts_a_waiting_low_priority_request_past_newer_better_ones() -> None:
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=1)
    s.add_request(make_request("blocker", 4, 40))
    step(s)
    s.add_request(make_request("low", 4, 2, priority=3))
    clock.now += 3.5  # low has waited 3 intervals: effective priority 0
    s.add_request(make_request("high", 4, 2, priority=0))
    ranks = Priorities(1.0, clock.now)
    assert (ranks.effective(s.waiting[0]), ranks.effective(s.waiting[1])) == (0, 0)
    s.abort("blocker")
    out, _ = step(s)
    assert [i.request.request_id for i in out.scheduled] == ["low"]  # tie: first come
    # Without aging the newer, better-priority request goes first.
    assert join_order([make_request("low", 4, 2, 3), make_request("high", 4, 2, 0)], aging_s=0.0) == [
        "high",
        "low",
    ]


def test_aging_counts_queued_time_only() -> None:
    clock = Clock()
    s = make_scheduler(clock)
    r = make_request("r", 4, 50, priority=5)
    s.add_request(r)
    clock.now += 2.5
    step(s)  # joins: 2.5 s queued
    clock.now += 100.0  # running time does not age it
    assert r.queued_at is None and r.waited_s == pytest.approx(2.5)
    assert Priorities(1.0, clock.now).effective(r) == 3
    assert Priorities(0.0, clock.now).effective(r) == 5


def test_mixed_and_bad_aging() -> None:
    assert not mixed([]) and not mixed([make_request("a", 2, 1, 4), make_request("b", 2, 1, 4)])
    assert mixed([make_request("a", 2, 1, 4), make_request("b", 2, 1, 3)])
    with pytest.raises(ValueError, match="aging"):
        make_scheduler(Clock(), aging_s=-1.0)


# -- priority preemption ---------------------------------------------------------------------

FILL = 4  # priority-10 streams that fill the 16-block pool: 12-token prompts growing past 16


def fill_pool(s: Scheduler, clock: Clock) -> list[Request]:
    streams = [make_request(f"low{i}", 12, 12, priority=10) for i in range(FILL)]
    for r in streams:
        s.add_request(r)
    for _ in range(3):
        step(s)
        clock.now += 0.01
    assert all(r.status is RequestStatus.RUNNING for r in streams)
    assert s.kv_cache.pool.num_free_blocks <= 1
    return streams


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_priority_0_request_preempts_priority_10_streams_at_once(mode: str) -> None:
    clock = Clock()
    s = make_scheduler(clock, host_blocks=32 if mode == "swap" else 0, preemption_mode=mode)
    streams = fill_pool(s, clock)
    urgent = make_request("urgent", 8, 4, priority=0)
    s.add_request(urgent)
    out, _ = step(s)
    # It joins in the very step it preempted for, its whole prompt computed: its first token.
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled if i.request is urgent] == [
        ("urgent", 8)
    ]
    assert urgent.num_output_tokens == 1
    victims = [r.request_id for r in out.preempted]
    assert victims and set(victims) <= {r.request_id for r in streams}
    assert victims[0] == "low3"  # the most recently admitted of the worst priority goes first
    assert s.num_priority_preemptions == len(victims) == s.num_preemptions
    assert all(i.request.request_id not in victims for i in out.scheduled)
    if mode == "swap":
        assert out.swapped_out and not out.swapped_in and s.num_swap_preemptions == len(victims)
        for r in out.swapped_out:  # only the blocks of its computed tokens were moved
            assert len(r.host_block_table) == -(-r.num_computed_tokens // 4)
    else:
        assert s.num_recompute_preemptions == len(victims)
    outputs: dict[str, list[int]] = {}
    drain(s, outputs, clock)
    assert outputs["urgent"] == alone("urgent", 8, 4)
    for r in streams:  # the victims resumed and finished as if never preempted
        assert outputs[r.request_id] == alone(r.request_id, 12, 12), r.request_id


def test_a_full_batch_gives_up_a_seat_to_a_better_priority() -> None:
    clock = Clock()
    s = make_scheduler(clock, num_blocks=64, max_num_seqs=2)
    for rid in ("x", "y"):
        s.add_request(make_request(rid, 4, 10, priority=10))
    step(s)
    s.add_request(make_request("urgent", 4, 2, priority=0))
    out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["y"]
    assert "urgent" in [i.request.request_id for i in out.scheduled]
    outputs: dict[str, list[int]] = {}
    drain(s, outputs, clock)
    assert outputs["y"] == alone("y", 4, 10)


def test_no_preemption_for_equal_priority_or_when_it_would_not_make_room() -> None:
    clock = Clock()
    s = make_scheduler(clock)
    streams = fill_pool(s, clock)
    streams[0].priority = streams[1].priority = 5  # only low2, low3 (8 blocks) rank below 7
    s.add_request(make_request("same", 8, 4, priority=10))  # not strictly better than any
    s.add_request(make_request("mid", 40, 4, priority=7))  # 10 blocks: more than 8 would free
    out, _ = step(s)
    assert not out.preempted and s.num_priority_preemptions == 0
    assert [r.request_id for r in s.waiting] == ["mid", "same"]


def test_an_aged_running_request_is_not_preempted_by_a_new_arrival_of_its_rank() -> None:
    clock = Clock()
    s = make_scheduler(clock, max_num_seqs=1, num_blocks=64)
    s.add_request(make_request("first", 4, 30, priority=0))
    step(s)
    s.add_request(make_request("old", 4, 30, priority=10))
    clock.now += 10.5  # "old" ages to effective priority 0 while it waits
    s.abort("first")
    step(s)
    s.add_request(make_request("new", 4, 2, priority=0))
    out, _ = step(s)
    assert not out.preempted and [i.request.request_id for i in out.scheduled] == ["old"]
    s.add_request(make_request("urgent", 4, 2, priority=-1))  # strictly better than both
    out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["old"]


def test_a_better_waiting_request_joins_ahead_of_swapped_out_work() -> None:
    clock = Clock()
    s = make_scheduler(clock, host_blocks=32, preemption_mode="swap")
    streams = fill_pool(s, clock)
    for _ in range(6):  # they grow past the pool: the newest are swapped out
        step(s)
    assert s.swapped
    s.add_request(make_request("urgent", 4, 2, priority=0))
    joined_in: list[ScheduledRequest] = []
    steps = 0
    while not joined_in:  # a step whose running requests preempt admits no one: the next one does
        out, _ = step(s)
        steps += 1
        assert not out.swapped_in and steps <= 2
        joined_in = [i for i in out.scheduled if i.request.request_id == "urgent"]
    assert s.swapped  # it went ahead of the swapped-out streams
    outputs: dict[str, list[int]] = {}
    drain(s, outputs, clock)
    for r in streams:
        assert outputs[r.request_id] == alone(r.request_id, 12, 12)


# -- without priorities, nothing changes -----------------------------------------------------


def trace(priority: int, aging_s: float, mode: str) -> list[tuple[list[tuple[str, int]], list[str]]]:
    clock = Clock()
    s = make_scheduler(clock, host_blocks=24, preemption_mode=mode, aging_s=aging_s)
    plans = []
    for i in range(8):
        s.add_request(make_request(f"r{i}", 6 + 3 * i % 11, 10 + i, priority=priority))
        for _ in range(2):
            out, _ = step(s)
            plans.append(
                (
                    [(x.request.request_id, x.num_new_tokens) for x in out.scheduled],
                    [r.request_id for r in out.preempted],
                )
            )
            clock.now += 0.7
    while s.has_unfinished():
        out, _ = step(s)
        plans.append(
            (
                [(x.request.request_id, x.num_new_tokens) for x in out.scheduled],
                [r.request_id for r in out.preempted],
            )
        )
        clock.now += 0.7
    assert s.num_preemptions > 0 and s.num_priority_preemptions == 0
    return plans


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_one_priority_for_all_schedules_exactly_as_without_priorities(mode: str) -> None:
    reference = trace(0, 0.0, mode)
    assert trace(0, 1.0, mode) == reference
    assert trace(7, 0.5, mode) == reference
