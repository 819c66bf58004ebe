"""Which drafted tokens a step verifies (scheduler/drafts.py) and how a verified run moves a
request's blocks (Scheduler.update_from_output): exact block ids and counts, no model."""

from __future__ import annotations

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.request import Request
from pagedserve.dataplane.scheduler import Scheduler
from pagedserve.dataplane.scheduler.drafts import drafts_to_verify


def decoding(kv: KVCacheManager, rid: str, length: int) -> Request:
    """A request whose `length` - 1 tokens are computed (it decodes its last one next)."""
    request = Request(rid, list(range(1, length + 1)), SamplingParams(max_tokens=64, ignore_eos=True))
    assert kv.allocate_slots(request, length - 1) is not None
    request.num_computed_tokens = length - 1
    return request


def test_drafts_are_cut_to_the_spare_budget() -> None:
    kv = KVCacheManager(BlockPool(16), 4, enable_prefix_caching=False)
    request = decoding(kv, "r", 6)
    request.spec_token_ids = [7, 8, 9, 10]
    assert drafts_to_verify(kv, request, 1, spare=5, num_running=1) == [7, 8, 9, 10]
    assert drafts_to_verify(kv, request, 1, spare=3, num_running=1) == [7, 8]
    assert drafts_to_verify(kv, request, 1, spare=1, num_running=1) == []


def test_drafts_never_take_the_blocks_other_requests_need() -> None:
    kv = KVCacheManager(BlockPool(4), 4, enable_prefix_caching=False)
    request = decoding(kv, "r", 4)  # 3 computed in block 0; its own next token fits there
    request.spec_token_ids = [7, 8, 9]  # positions 4..6: one more block
    assert kv.pool.num_free_blocks == 3
    assert drafts_to_verify(kv, request, 1, spare=8, num_running=2) == [7, 8, 9]
    assert drafts_to_verify(kv, request, 1, spare=8, num_running=3) == []  # 1 + 3 > 3 free
    request.spec_token_ids = [7, 8, 9, 10, 11, 12, 13]  # positions 4..10: two more blocks
    assert drafts_to_verify(kv, request, 1, spare=16, num_running=1) == [7, 8, 9, 10, 11, 12, 13]
    assert drafts_to_verify(kv, request, 1, spare=16, num_running=2) == []


def test_a_verified_run_keeps_accepted_tokens_and_frees_the_rejected_slots() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64), 256)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request(request)
    out = scheduler.schedule()  # the prompt
    scheduler.update_from_output(out, {"r": 4})
    assert request.all_token_ids == [1, 2, 3, 4] and request.block_table == [0]
    request.spec_token_ids = [5, 6, 7, 8, 9, 10]  # 1 + 6 tokens: positions 3..9, blocks 0-2
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 7 and out.scheduled[0].spec_token_ids == [5, 6, 7, 8, 9, 10]
    assert request.block_table == [0, 1, 2]
    # Drafts 5 and 6 accepted, 7 rejected (the step sampled 70 there): tokens 4, 5, 6 computed.
    finished = scheduler.update_from_output(out, {"r": 70}, {"r": [5, 6]})
    assert finished == []
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 70]
    assert request.num_computed_tokens == 6
    assert request.block_table == [0, 1]  # block 2 held only rejected slots: back in the pool
    assert pool.num_free_blocks == 6
    # Only block 0 (tokens 1-4, all accepted) is full and cached; block 1 holds 5, 6 so far.
    assert len(request.block_hashes) >= 1 and pool.num_cached_blocks == 1
    scheduler.check_integrity()


def test_a_stop_inside_an_accepted_run_ends_the_request_there() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, SchedulerConfig(), 256)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=(6,)))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": 4})
    request.spec_token_ids = [5, 6, 7]
    out = scheduler.schedule()
    finished = scheduler.update_from_output(out, {"r": 8}, {"r": [5, 6, 7]})
    assert finished == [request] and request.output_token_ids == [4, 5, 6]
    assert request.finish_reason == "stop"
    assert pool.num_free_blocks == 8
