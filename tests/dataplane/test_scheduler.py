"""Scheduler driven without a model: exact plans, block ids, preemption victims and stop reasons.

A model step is simulated by `schedule()` followed by `update_from_output(out, sampled)`, where
`sampled` holds a token for every ScheduledRequest whose `samples` was true at schedule time.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, watermark=0.0
    )
    return Scheduler(kv, config, max_model_len)


def bounded(prompt_tokens: int) -> SchedulerConfig:
    """A batch of 8 and 64 tokens whose prompts take at most `prompt_tokens` a step while
    others decode."""
    return SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        watermark=0.0,
        max_prefill_tokens_while_decoding=prompt_tokens,
    )


def make_request(
    request_id: str, num_prompt_tokens: int, max_tokens: int = 16, eos: int | None = None, **params: object
) -> Request:
    prompt = [10 + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=eos)  # type: ignore[arg-type]


@dataclass
class Step:
    plan: list[tuple[str, int, bool]]  # (request id, num_new_tokens, samples) in schedule order
    preempted: list[str]
    finished: list[str]
    output: SchedulerOutput


def plan_of(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]


def finish_step(
    s: Scheduler, out: SchedulerOutput, tokens: dict[str, int] | None = None, default: int = 7
) -> Step:
    plan = plan_of(out)
    sampled = {rid: (tokens or {}).get(rid, default) for rid, _, samples in plan if samples}
    finished = s.update_from_output(out, sampled)
    s.check_integrity()
    return Step(plan, [r.request_id for r in out.preempted], [r.request_id for r in finished], out)


def step(s: Scheduler, tokens: dict[str, int] | None = None, default: int = 7) -> Step:
    return finish_step(s, s.schedule(), tokens, default)


def ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def free_ids(s: Scheduler) -> list[int]:
    return s.kv_cache.pool.free_queue.block_ids()


# -- torch-free core -------------------------------------------------------------------------

TORCH_FREE_MODULES = [
    "pagedserve.dataplane.kvcache",
    "pagedserve.common.block_hash",
    "pagedserve.dataplane.kvcache.block_pool",
    "pagedserve.dataplane.kvcache.kv_events",
    "pagedserve.dataplane.kvcache.kv_cache_manager",
    "pagedserve.dataplane.scheduler",
    "pagedserve.dataplane.request",
    "pagedserve.dataplane.scheduler.scheduler",
    "pagedserve.dataplane.scheduler.output",
    "pagedserve.common.sampling_params",
    "pagedserve.dataplane.config",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_core_module_imports_first_and_without_torch(module: str) -> None:
    """Each module, imported first in a fresh interpreter, works and pulls in no torch.

    Importing each one first also catches import-order cycles inside the core.
    """
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        "for m in " + repr(TORCH_FREE_MODULES) + ":\n"
        "    importlib.import_module(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "assert 'torch' not in sys.modules, heavy\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- one request, step by step ---------------------------------------------------------------


def test_single_request_prefill_then_decode_to_max_tokens() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    a = make_request("a", 5, max_tokens=3)
    s.add_request(a)
    assert ids(s.waiting) == ["a"]
    assert [r.status for r in s.waiting] == [RequestStatus.WAITING]
    assert s.has_unfinished()

    st = step(s, {"a": 31})
    assert st.plan == [("a", 5, True)]
    assert st.finished == []
    assert ids(s.running) == ["a"]
    assert [r.status for r in s.running] == [RequestStatus.RUNNING]
    assert a.block_table == [0, 1]
    assert a.num_computed_tokens == 5
    assert a.output_token_ids == [31]
    assert a.first_token_time is not None
    assert (s.num_running, s.num_waiting) == (1, 0)

    st = step(s, {"a": 32})
    assert st.plan == [("a", 1, True)]
    assert a.num_computed_tokens == 6
    assert a.block_table == [0, 1]

    st = step(s, {"a": 33})
    assert st.plan == [("a", 1, True)]
    assert st.finished == ["a"]
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.finish_reason == "length"
    assert a.output_token_ids == [31, 32, 33]
    assert a.num_computed_tokens == 7
    assert a.block_table == []
    assert free_ids(s) == [2, 3, 1, 0]  # freed in reverse, at the back of the queue
    assert s.requests == {}
    assert not s.has_unfinished()
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.schedule().is_empty


def test_chunked_prefill_10_tokens_budget_4() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    a = make_request("a", 10, max_tokens=3)
    s.add_request(a)

    expected = [
        # plan, computed after, block table after, outputs so far
        ([("a", 4, False)], 4, [0], 0),
        ([("a", 4, False)], 8, [0, 1], 0),
        ([("a", 2, True)], 10, [0, 1, 2], 1),
        ([("a", 1, True)], 11, [0, 1, 2], 2),
        ([("a", 1, True)], 12, [0, 1, 2], 3),
    ]
    for plan, computed, table, num_out in expected:
        st = step(s)
        assert st.plan == plan
        assert st.output.num_batched_tokens <= 4
        assert a.num_computed_tokens == computed
        assert a.num_output_tokens == num_out
        if num_out < 3:
            assert a.block_table == table
    assert a.first_token_time is not None
    assert a.finish_reason == "length"
    assert a.output_token_ids == [7, 7, 7]
    assert s.kv_cache.pool.num_free_blocks == 8


def test_budget_is_shared_running_first_then_waiting() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    a, b = make_request("a", 3, max_tokens=2), make_request("b", 3, max_tokens=2)
    s.add_request(a)
    s.add_request(b)

    st = step(s)
    assert st.plan == [("a", 3, True), ("b", 1, False)]  # b joins with what budget is left
    assert (a.block_table, b.block_table) == ([0], [1])
    assert b.num_computed_tokens == 1

    st = step(s)
    assert st.plan == [("a", 1, True), ("b", 2, True)]
    assert st.finished == ["a"]
    assert b.num_computed_tokens == 3

    st = step(s)
    assert st.plan == [("b", 1, True)]
    assert st.finished == ["b"]
    assert free_ids(s) == [2, 3, 4, 5, 6, 7, 0, 1]


def test_running_requests_past_the_budget_wait_their_turn() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=2)
    for rid in "abc":
        s.add_request(make_request(rid, 1, max_tokens=3))

    assert step(s).plan == [("a", 1, True), ("b", 1, True)]
    # c cannot join: the budget is spent on the running requests first.
    assert step(s).plan == [("a", 1, True), ("b", 1, True)]
    st = step(s)
    assert st.plan == [("a", 1, True), ("b", 1, True)]
    assert st.finished == ["a", "b"]
    assert step(s).plan == [("c", 1, True)]


# -- continuous batching ---------------------------------------------------------------------


def test_finished_request_leaves_and_waiting_one_joins_next_step() -> None:
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    a = make_request("a", 2, max_tokens=1)
    b = make_request("b", 2, max_tokens=3)
    c = make_request("c", 3, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)

    st = step(s)
    assert st.plan == [("a", 2, True), ("b", 2, True)]  # max_num_seqs keeps c waiting
    assert st.finished == ["a"]
    assert ids(s.running) == ["b"]
    assert ids(s.waiting) == ["c"]
    assert free_ids(s) == [*range(2, 16), 0]

    st = step(s)
    assert st.plan == [("b", 1, True), ("c", 3, True)]
    assert c.block_table == [2]
    assert ids(s.running) == ["b", "c"]

    st = step(s)
    assert st.plan == [("b", 1, True), ("c", 1, True)]
    assert st.finished == ["b", "c"]
    assert s.schedule().is_empty
    assert s.kv_cache.pool.num_free_blocks == 16


def test_eos_finish_makes_room_for_the_next_request() -> None:
    s = make_scheduler(max_num_seqs=1)
    a = make_request("a", 2, max_tokens=50, eos=EOS)
    b = make_request("b", 2, max_tokens=1, eos=EOS)
    s.add_request(a)
    s.add_request(b)
    assert step(s, {"a": 5}).plan == [("a", 2, True)]
    st = step(s, {"a": EOS})
    assert st.plan == [("a", 1, True)]
    assert st.finished == ["a"]
    assert a.finish_reason == "stop"
    assert step(s).plan == [("b", 2, True)]


def test_waiting_queue_is_first_come_first_served_on_blocks() -> None:
    s = make_scheduler(num_blocks=3, block_size=4)
    a = make_request("a", 8, max_tokens=4)
    b = make_request("b", 8, max_tokens=1)
    c = make_request("c", 1, max_tokens=1)
    for r in (a, b, c):
        s.add_request(r)

    # b needs 2 blocks but 1 is free; c would fit in it but does not overtake b.
    assert step(s).plan == [("a", 8, True)]
    assert ids(s.waiting) == ["b", "c"]
    assert step(s).plan == [("a", 1, True)]
    assert a.block_table == [0, 1, 2]
    assert step(s).plan == [("a", 1, True)]
    st = step(s)
    assert st.plan == [("a", 1, True)]
    assert st.finished == ["a"]
    assert free_ids(s) == [2, 1, 0]
    # b's prompt is a's first 8 tokens: a's cached block 0 is a hit (block 1 would be too,
    # but at least one token must be computed), so b computes only its second block.
    out = s.schedule()
    assert plan_of(out) == [("b", 4, True), ("c", 1, True)]
    assert (b.block_table, c.block_table) == ([0, 2], [1])
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 0)
    assert finish_step(s, out).finished == ["b", "c"]
    assert free_ids(s) == [2, 0, 1]


# -- preemption by recompute -----------------------------------------------------------------


def test_preemption_evicts_the_most_recently_admitted_and_it_resumes_with_its_tokens() -> None:
    s = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=3)
    a = make_request("a", 4, max_tokens=3)
    b = make_request("b", 3, max_tokens=2)
    c = make_request("c", 3, max_tokens=3)
    d = make_request("d", 1, max_tokens=1)
    for r in (a, b, c, d):
        s.add_request(r)

    st = step(s, {"a": 41, "b": 51, "c": 61})
    assert st.plan == [("a", 4, True), ("b", 3, True), ("c", 3, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    assert free_ids(s) == []
    assert ids(s.waiting) == ["d"]

    # a needs a third block; none is free: c (admitted last, not b) is preempted.
    out = s.schedule()
    assert plan_of(out) == [("a", 1, True), ("b", 1, True)]
    assert ids(out.preempted) == ["c"]
    assert c.status is RequestStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.block_table == []
    assert c.num_preemptions == 1
    assert s.num_preemptions == 1
    assert c.output_token_ids == [61]  # generated tokens are kept for the recompute
    assert ids(s.waiting) == ["c", "d"]  # at the head, ahead of d
    assert ids(s.running) == ["a", "b"]
    assert a.block_table == [0, 1, 5]  # c's blocks came back reversed: [5, 4]
    assert free_ids(s) == [4]
    # d would fit in block 4, but nothing is admitted in a step that preempted.
    assert "d" not in [rid for rid, _, _ in plan_of(out)]
    s.check_integrity()
    st = finish_step(s, out, {"a": 42, "b": 52})
    assert st.finished == ["b"]
    assert free_ids(s) == [4, 3, 2]

    # c recomputes prompt + its kept token (4 tokens) and samples its second token. Its
    # first block [10, 11] is cached three times (a's 0, b's 2, its own old 4): the hit
    # shares a's referenced copy, so c computes only [12, 61] into a new block, 4 (evicting
    # its own old copy: block 0 still holds that hash). d takes block 3, evicting b's [12, 51].
    st = step(s, {"a": 43, "c": 62, "d": 71})
    assert st.plan == [("a", 1, True), ("c", 2, True), ("d", 1, True)]
    assert st.finished == ["a", "d"]
    assert c.block_table == [0, 4]
    assert d.block_table == []
    assert c.output_token_ids == [61, 62]
    assert ids(s.running) == ["c"]
    assert s.kv_cache.pool.blocks[0].ref_cnt == 1  # a let go of it, c still holds it
    assert free_ids(s) == [2, 5, 1, 3]
    stats = s.kv_cache.prefix_cache_stats
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 4, 2)
    assert c.num_cached_tokens == 0  # at its first admission nothing was cached yet

    st = step(s, {"c": 63})
    assert st.plan == [("c", 1, True)]
    assert st.finished == ["c"]
    assert c.finish_reason == "length"
    assert c.output_token_ids == [61, 62, 63]
    assert c.all_token_ids == [10, 11, 12, 61, 62, 63]
    assert a.output_token_ids == [41, 42, 43]
    assert s.num_preemptions == 1
    assert free_ids(s) == [5, 1, 3, 2, 4, 0]
    assert s.kv_cache.pool.num_free_blocks == 6


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest() -> None:
    s = make_scheduler(num_blocks=6, block_size=1, max_num_batched_tokens=4)
    a = make_request("a", 1, max_tokens=3)
    b = make_request("b", 5, max_tokens=1)
    s.add_request(a)
    s.add_request(b)

    st = step(s)
    assert st.plan == [("a", 1, True), ("b", 3, False)]
    assert (a.block_table, b.block_table) == ([0], [1, 2, 3])

    # b's next chunk needs 2 blocks, 1 is free after a's decode; b is the newest, so b goes.
    st = step(s)
    assert st.plan == [("a", 1, True)]
    assert st.preempted == ["b"]
    assert a.block_table == [0, 4]
    assert (b.num_computed_tokens, b.block_table, b.status) == (0, [], RequestStatus.WAITING)
    assert free_ids(s) == [5, 3, 2, 1]
    assert s.num_preemptions == 1

    # b's first three tokens are still cached ([10] in a's block 0, [11] and [12] in its own
    # old blocks 2 and 3). Resuming from them, b's next chunk (tokens 3 and 4) needs two new
    # blocks besides the two evictable hits: four of the three free blocks, so b waits.
    st = step(s)
    assert st.plan == [("a", 1, True)]
    assert st.finished == ["a"]
    assert free_ids(s) == [3, 2, 1, 5, 4, 0]
    # With a gone everything fits: b computes 2 tokens instead of recomputing 5.
    st = step(s)
    assert st.plan == [("b", 2, True)]
    assert st.finished == ["b"]
    stats = s.kv_cache.prefix_cache_stats
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 5, 3)
    assert free_ids(s) == [4, 5, 1, 3, 2, 0]  # b held [0, 2, 3, 1, 5]
    assert b.num_preemptions == 1


# -- stop conditions -------------------------------------------------------------------------


def run_tokens(s: Scheduler, request: Request, tokens: list[int]) -> int:
    """Feed `tokens` one per sampling step until `request` finishes; return how many were used."""
    s.add_request(request)
    used = 0
    while request.finish_reason is None:
        out = s.schedule()
        assert [x.request for x in out.scheduled] == [request]
        sampled = {}
        if out.scheduled[0].samples:
            sampled = {request.request_id: tokens[used]}
            used += 1
        s.update_from_output(out, sampled)
        s.check_integrity()
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks
    return used


def test_eos_stops() -> None:
    r = make_request("r", 2, max_tokens=10, eos=EOS)
    assert run_tokens(make_scheduler(), r, [5, 6, EOS, 8]) == 3
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.finish_reason == "stop"
    assert r.output_token_ids == [5, 6, EOS]


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = make_request("r", 2, max_tokens=3, eos=EOS, ignore_eos=True)
    assert run_tokens(make_scheduler(), r, [EOS, EOS, EOS, EOS]) == 3
    assert r.finish_reason == "length"
    assert r.output_token_ids == [EOS, EOS, EOS]


def test_no_eos_token_id_means_no_eos_stop() -> None:
    r = make_request("r", 2, max_tokens=2, eos=None)
    assert run_tokens(make_scheduler(), r, [EOS, EOS, EOS]) == 2
    assert r.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    r = make_request("r", 2, max_tokens=10, eos=EOS, ignore_eos=True, stop_token_ids=(9, 4))
    assert run_tokens(make_scheduler(), r, [EOS, 5, 4, 9]) == 3
    assert r.finish_reason == "stop"
    assert r.output_token_ids == [EOS, 5, 4]


def test_max_tokens_gives_length() -> None:
    r = make_request("r", 3, max_tokens=4)
    assert run_tokens(make_scheduler(), r, [1, 1, 1, 1, 1]) == 4
    assert r.finish_reason == "length"
    assert r.num_output_tokens == 4


def test_eos_on_the_last_allowed_token_is_stop() -> None:
    r = make_request("r", 3, max_tokens=2, eos=EOS)
    assert run_tokens(make_scheduler(), r, [1, EOS]) == 2
    assert r.finish_reason == "stop"


def test_max_model_len_gives_length() -> None:
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=8)
    r = make_request("r", 5, max_tokens=100)
    assert run_tokens(s, r, [1] * 10) == 3
    assert r.finish_reason == "length"
    assert r.num_tokens == 8
    assert r.num_computed_tokens == 7  # the last token is sampled, never computed


# -- abort -----------------------------------------------------------------------------------


def test_abort_from_waiting() -> None:
    s = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_request("a", 3), make_request("b", 3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    queue_before = free_ids(s)

    assert s.abort("b") is b
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert b.finish_reason == "abort"
    assert ids(s.waiting) == []
    assert list(s.requests) == ["a"]
    assert free_ids(s) == queue_before
    s.check_integrity()
    assert s.abort("b") is None
    assert s.abort("nobody") is None
    assert step(s).plan == [("a", 1, True)]


def test_abort_from_running_frees_its_blocks_and_others_continue() -> None:
    s = make_scheduler(num_blocks=8, block_size=2)
    a, b = make_request("a", 5, max_tokens=5), make_request("b", 3, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])

    assert s.abort("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert a.block_table == []
    assert free_ids(s) == [5, 6, 7, 2, 1, 0]
    assert ids(s.running) == ["b"]
    s.check_integrity()
    assert step(s).plan == [("b", 1, True)]
    assert b.block_table == [3, 4]
    assert s.abort("b") is b
    assert s.kv_cache.pool.num_free_blocks == 8
    assert not s.has_unfinished()


def test_abort_between_schedule_and_update_skips_the_request() -> None:
    s = make_scheduler()
    a, b = make_request("a", 3), make_request("b", 3)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert s.abort("a") is a
    finished = s.update_from_output(out, {"a": 5, "b": 6})
    assert finished == []
    assert a.num_computed_tokens == 0
    assert a.output_token_ids == []
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert b.num_computed_tokens == 3
    assert b.output_token_ids == [6]
    s.check_integrity()


def test_abort_a_preempted_request() -> None:
    s = make_scheduler(num_blocks=6, block_size=1, max_num_batched_tokens=4)
    s.add_request(make_request("a", 1, max_tokens=3))
    s.add_request(make_request("b", 5, max_tokens=1))
    step(s)
    assert step(s).preempted == ["b"]
    assert free_ids(s) == [5, 3, 2, 1]
    b = s.abort("b")
    assert b is not None and b.finish_reason == "abort"
    assert free_ids(s) == [5, 3, 2, 1]
    assert ids(s.waiting) == []
    s.check_integrity()


def test_finished_and_aborted_ids_can_be_reused() -> None:
    s = make_scheduler()
    first = make_request("a", 2, max_tokens=1)
    s.add_request(first)
    assert step(s).finished == ["a"]
    assert s.abort("a") is None
    assert first.finish_reason == "length"
    second = make_request("a", 2, max_tokens=1)
    s.add_request(second)
    assert s.abort("a") is second
    third = make_request("a", 2, max_tokens=1)
    s.add_request(third)
    assert step(s).finished == ["a"]
    assert third.finish_reason == "length"


# -- add_request refusals --------------------------------------------------------------------


def assert_refused(s: Scheduler, request: Request, match: str) -> None:
    waiting, known = ids(s.waiting), dict(s.requests)
    with pytest.raises(ValueError, match=match):
        s.add_request(request)
    assert ids(s.waiting) == waiting
    assert s.requests == known
    s.check_integrity()


def test_prompt_must_leave_room_below_max_model_len() -> None:
    s = make_scheduler(max_model_len=8)
    assert_refused(s, make_request("eq", 8), r"prompt has 8 tokens, but max_model_len is 8")
    assert_refused(s, make_request("gt", 9), r"prompt has 9 tokens, but max_model_len is 8")
    ok = make_request("ok", 7, max_tokens=5)
    s.add_request(ok)
    st = step(s)
    assert st.plan == [("ok", 7, True)]
    assert st.finished == ["ok"]  # 8 tokens == max_model_len after one token
    assert ok.finish_reason == "length"


def test_request_needing_more_blocks_than_the_pool_is_refused() -> None:
    s = make_scheduler(num_blocks=2, block_size=4)
    assert_refused(
        s, make_request("big", 4, max_tokens=5), r"needs 3 KV blocks but the whole pool has only 2"
    )
    fits = make_request("fits", 4, max_tokens=4)  # 8 tokens = exactly 2 blocks
    s.add_request(fits)
    while s.has_unfinished():
        step(s)
    assert fits.finish_reason == "length"
    assert fits.num_output_tokens == 4


def test_block_need_is_capped_by_max_model_len() -> None:
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=8)
    r = make_request("r", 4, max_tokens=1000)
    s.add_request(r)
    while s.has_unfinished():
        step(s)
    assert r.finish_reason == "length"
    assert r.num_output_tokens == 4


def test_duplicate_request_id_is_refused_and_keeps_the_original() -> None:
    s = make_scheduler()
    a = make_request("a", 3, max_tokens=2)
    s.add_request(a)
    dup = make_request("a", 5)
    assert_refused(s, dup, r"request_id 'a' is already in use")
    assert s.requests["a"] is a
    step(s)
    assert_refused(s, dup, "already in use")  # also while running
    assert step(s).finished == ["a"]
    assert dup.status is RequestStatus.WAITING  # never entered the scheduler
    assert dup.num_computed_tokens == 0


def test_scheduler_keeps_serving_after_refusals() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    s.add_request(make_request("a", 3, max_tokens=3))
    step(s)
    assert_refused(s, make_request("long", 32), "max_model_len")
    assert_refused(s, make_request("huge", 10, max_tokens=10), "KV blocks")
    assert_refused(s, make_request("a", 1), "already in use")
    s.add_request(make_request("b", 2, max_tokens=2))
    finished: list[str] = []
    for _ in range(5):
        finished += step(s).finished
    assert finished == ["a", "b"]
    assert s.kv_cache.pool.num_free_blocks == 4


# -- prompt tokens bounded while others decode ----------------------------------------------


def distinct_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
    """A request whose prompt shares no block with another's (no prefix-cache hits)."""
    base = 1000 * (1 + sum(map(ord, request_id)))
    prompt = [base + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def test_a_burst_of_prompts_prefills_a_bounded_number_of_tokens_per_step_while_others_decode() -> None:
    kv = KVCacheManager(BlockPool(64), 4)
    s = Scheduler(kv, bounded(6), 256)
    s.add_request(make_request("guard", 3, max_tokens=20))
    assert step(s).plan == [("guard", 3, True)]  # nothing decodes yet: no bound
    for name in ("a", "b", "c"):
        s.add_request(distinct_request(name, 5, max_tokens=2))
    # guard decodes; 6 prompt tokens a step go to the newcomers, in arrival order, chunked
    assert step(s).plan == [("guard", 1, True), ("a", 5, True), ("b", 1, False)]
    # a decodes now (not a prompt token): b's 4 and 2 of c's make the 6
    second = step(s)
    assert second.plan == [("guard", 1, True), ("a", 1, True), ("b", 4, True), ("c", 2, False)]
    assert second.finished == ["a"]  # max_tokens 2
    last = step(s)
    assert last.plan == [("guard", 1, True), ("b", 1, True), ("c", 3, True)]
    assert last.finished == ["b"]


def test_without_the_bound_the_burst_prefills_in_one_step() -> None:
    s = make_scheduler(num_blocks=64)
    s.add_request(make_request("guard", 3, max_tokens=20))
    step(s)
    for name in ("a", "b", "c"):
        s.add_request(distinct_request(name, 5, max_tokens=2))
    assert step(s).plan == [("guard", 1, True), ("a", 5, True), ("b", 5, True), ("c", 5, True)]


def test_the_bound_applies_only_while_a_request_decodes() -> None:
    kv = KVCacheManager(BlockPool(64), 4)
    s = Scheduler(kv, bounded(2), 256)
    for name in ("a", "b"):
        s.add_request(distinct_request(name, 5, max_tokens=3))
    assert step(s).plan == [("a", 5, True), ("b", 5, True)]  # prompts alone: the whole budget
    assert step(s).plan == [("a", 1, True), ("b", 1, True)]


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be an integer >= 1, got 0"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0)
