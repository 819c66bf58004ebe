"""KVCacheManager.allocate_slots / free: query-then-commit, block boundaries, exact ids."""

from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager, cdiv
from pagedserve.dataplane.request import Request


def make(num_blocks: int, block_size: int) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks)
    return pool, KVCacheManager(pool, block_size)


def request(request_id: str = "r", num_prompt_tokens: int = 1) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams())


def compute(kv: KVCacheManager, req: Request, num_new_tokens: int) -> list[int] | None:
    """Allocate like the scheduler does, then mark the tokens computed like a model step does."""
    new = kv.allocate_slots(req, num_new_tokens)
    if new is not None:
        req.num_computed_tokens += num_new_tokens
    return new


@pytest.mark.parametrize(
    ("a", "b", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (16, 16, 1), (17, 16, 2), (3, 1, 3)]
)
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(BlockPool(2), block_size)


@pytest.mark.parametrize(
    ("block_size", "num_tokens", "expected_ids"),
    [
        (1, 1, [0]),
        (1, 3, [0, 1, 2]),
        (4, 1, [0]),
        (4, 4, [0]),
        (4, 5, [0, 1]),
        (4, 10, [0, 1, 2]),
        (16, 1, [0]),
        (16, 16, [0]),
        (16, 17, [0, 1]),
        (16, 33, [0, 1, 2]),
    ],
)
def test_first_allocation_covers_exactly_the_blocks_needed(
    block_size: int, num_tokens: int, expected_ids: list[int]
) -> None:
    pool, kv = make(8, block_size)
    req = request(num_prompt_tokens=num_tokens)
    assert kv.allocate_slots(req, num_tokens) == expected_ids
    assert req.block_table == expected_ids
    assert req.num_computed_tokens == 0  # allocation reserves slots; it does not compute them
    assert pool.free_queue.block_ids() == list(range(len(expected_ids), 8))
    assert kv.usage == len(expected_ids) / 8
    kv.check_integrity()


def test_block_size_4_grows_only_at_block_boundaries() -> None:
    pool, kv = make(8, 4)
    req = request(num_prompt_tokens=10)
    assert compute(kv, req, 10) == [0, 1, 2]  # 10 tokens: last block partly filled (2 of 4)
    assert compute(kv, req, 1) == []  # token 11 goes in block 2
    assert compute(kv, req, 1) == []  # token 12 fills block 2
    assert req.block_table == [0, 1, 2]
    assert compute(kv, req, 1) == [3]  # token 13 starts a new block
    assert compute(kv, req, 4) == [4]  # tokens 14..17
    assert req.block_table == [0, 1, 2, 3, 4]
    assert req.num_computed_tokens == 17
    assert kv.allocate_slots(req, 0) == []
    assert pool.free_queue.block_ids() == [5, 6, 7]
    kv.check_integrity()


def test_block_size_1_takes_one_block_per_token() -> None:
    pool, kv = make(5, 1)
    req = request(num_prompt_tokens=2)
    assert compute(kv, req, 2) == [0, 1]
    assert compute(kv, req, 1) == [2]
    assert compute(kv, req, 2) == [3, 4]
    assert req.block_table == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert kv.allocate_slots(req, 1) is None
    assert req.block_table == [0, 1, 2, 3, 4]
    kv.check_integrity()


def test_block_size_16_partial_last_block() -> None:
    pool, kv = make(3, 16)
    req = request(num_prompt_tokens=20)
    assert compute(kv, req, 20) == [0, 1]
    for _ in range(12):  # tokens 21..32 fill block 1
        assert compute(kv, req, 1) == []
    assert compute(kv, req, 1) == [2]  # token 33
    assert req.block_table == [0, 1, 2]
    assert pool.num_free_blocks == 0
    kv.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    pool, kv = make(3, 4)
    other = request("other", 4)
    assert compute(kv, other, 4) == [0]
    req = request("r", 4)
    assert compute(kv, req, 4) == [1]
    queue_before = pool.free_queue.block_ids()
    refs_before = [b.ref_cnt for b in pool.blocks]
    assert queue_before == [2]

    # 4 computed + 9 new = 13 tokens -> 4 blocks; holds 1, needs 3, only 1 free.
    assert kv.allocate_slots(req, 9) is None
    assert req.block_table == [1]
    assert req.num_computed_tokens == 4
    assert pool.free_queue.block_ids() == queue_before
    assert [b.ref_cnt for b in pool.blocks] == refs_before
    kv.check_integrity()

    # What does fit still commits.
    assert kv.allocate_slots(req, 4) == [2]  # 8 tokens -> 2 blocks
    assert req.block_table == [1, 2]
    kv.check_integrity()


def test_allocation_larger_than_an_empty_table_can_get_returns_none() -> None:
    pool, kv = make(2, 4)
    req = request(num_prompt_tokens=9)
    assert kv.allocate_slots(req, 9) is None
    assert req.block_table == []
    assert pool.free_queue.block_ids() == [0, 1]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_free_returns_blocks_in_reverse_order_to_the_back_of_the_queue() -> None:
    pool, kv = make(8, 4)
    req = request(num_prompt_tokens=12)
    assert compute(kv, req, 12) == [0, 1, 2]
    kv.free(req)
    assert req.block_table == []
    assert pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    kv.check_integrity()


def test_interleaved_requests_get_disjoint_ids_and_free_in_reverse() -> None:
    pool, kv = make(8, 2)
    a, b = request("a", 4), request("b", 3)
    assert compute(kv, a, 4) == [0, 1]
    assert compute(kv, b, 3) == [2, 3]
    assert compute(kv, a, 1) == [4]
    assert compute(kv, b, 1) == []
    assert compute(kv, b, 1) == [5]
    assert a.block_table == [0, 1, 4]
    assert b.block_table == [2, 3, 5]
    kv.free(a)
    assert pool.free_queue.block_ids() == [6, 7, 4, 1, 0]
    kv.free(b)
    assert pool.free_queue.block_ids() == [6, 7, 4, 1, 0, 5, 3, 2]
    assert pool.num_free_blocks == kv.num_total_blocks == 8
    kv.check_integrity()

    # The next request reuses blocks in free-queue order.
    c = request("c", 6)
    assert compute(kv, c, 6) == [6, 7, 4]


def test_freeing_twice_is_a_double_free() -> None:
    pool, kv = make(4, 4)
    req = request(num_prompt_tokens=4)
    assert compute(kv, req, 4) == [0]
    table = list(req.block_table)
    kv.free(req)
    req.block_table = table  # a stale table handed back again
    with pytest.raises(RuntimeError, match="double free"):
        kv.free(req)
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
