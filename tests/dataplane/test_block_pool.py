"""BlockPool and FreeBlockQueue: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.dataplane.kvcache.block_pool import Block, BlockPool, FreeBlockQueue


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def backward_ids(queue: FreeBlockQueue) -> list[int]:
    """Walk the queue tail to head through `prev_free`, so both link directions are checked."""
    ids = []
    node = queue._tail.prev_free
    while node is not None and node is not queue._head:
        ids.append(node.block_id)
        node = node.prev_free
    return ids[::-1]


# -- BlockPool -------------------------------------------------------------------------------


def test_fresh_pool_has_every_block_free_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4]
    assert backward_ids(pool.free_queue) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert ref_counts(pool) == [0, 0, 0, 0, 0]
    pool.check_integrity()


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_at_least_one_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_allocate_takes_ids_from_the_front_in_order() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert first is not None
    assert [b.block_id for b in first] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in first)
    second = pool.allocate(2)
    assert second is not None
    assert [b.block_id for b in second] == [3, 4]
    assert pool.free_queue.block_ids() == [5, 6, 7]
    assert ref_counts(pool) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 5
    assert pool.usage == 5 / 8
    # Allocated blocks are unlinked from the free queue.
    assert all(b.prev_free is None and b.next_free is None for b in first + second)
    pool.check_integrity()


def test_allocate_zero_returns_empty_and_changes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.free_queue.block_ids() == [0, 1, 2]
    assert ref_counts(pool) == [0, 0, 0]


def test_allocate_negative_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)
    assert pool.free_queue.block_ids() == [0, 1, 2]


def test_allocate_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) is not None
    pool.free([0])  # free queue is now [2, 3, 0]
    before_queue = pool.free_queue.block_ids()
    before_refs = ref_counts(pool)
    assert before_queue == [2, 3, 0]

    assert pool.allocate(4) is None
    assert pool.free_queue.block_ids() == before_queue
    assert backward_ids(pool.free_queue) == before_queue
    assert ref_counts(pool) == before_refs
    assert pool.num_free_blocks == 3
    pool.check_integrity()

    # Exactly what is free still fits, in free-queue order.
    taken = pool.allocate(3)
    assert taken is not None
    assert [b.block_id for b in taken] == [2, 3, 0]
    assert pool.num_free_blocks == 0
    assert pool.allocate(1) is None
    assert pool.usage == 1.0
    pool.check_integrity()


def test_free_appends_to_the_back_in_the_order_given() -> None:
    pool = BlockPool(8)
    assert pool.allocate(5) is not None
    pool.free([2, 0])
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 0]
    pool.free([4])
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 0, 4]
    assert backward_ids(pool.free_queue) == [5, 6, 7, 2, 0, 4]
    assert ref_counts(pool) == [0, 1, 0, 1, 0, 0, 0, 0]
    pool.check_integrity()

    # Reuse follows the free queue: never-used blocks first, then the freed ones, oldest first.
    taken = pool.allocate(5)
    assert taken is not None
    assert [b.block_id for b in taken] == [5, 6, 7, 2, 0]
    assert pool.free_queue.block_ids() == [4]
    pool.check_integrity()


def test_incref_and_free_count_references() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) is not None
    pool.incref([1])
    pool.incref([1, 0])
    assert ref_counts(pool) == [2, 3, 0, 0]
    assert pool.num_used_blocks == 2
    pool.check_integrity()

    pool.free([1])
    assert ref_counts(pool) == [2, 2, 0, 0]
    assert pool.free_queue.block_ids() == [2, 3]
    pool.free([1, 0])
    assert ref_counts(pool) == [1, 1, 0, 0]
    assert pool.free_queue.block_ids() == [2, 3]
    # The last reference returns a block to the free queue.
    pool.free([1])
    assert ref_counts(pool) == [1, 0, 0, 0]
    assert pool.free_queue.block_ids() == [2, 3, 1]
    pool.free([0])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_incref_on_a_free_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    with pytest.raises(RuntimeError, match="incref on unreferenced"):
        pool.incref([2])
    assert ref_counts(pool) == [0, 0, 0]
    assert pool.free_queue.block_ids() == [0, 1, 2]
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) is not None
    pool.free([0])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([0])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    assert ref_counts(pool) == [0, 0, 0]
    pool.check_integrity()


def test_freeing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1])
    assert pool.free_queue.block_ids() == [0, 1, 2]


# -- FreeBlockQueue --------------------------------------------------------------------------


def make_queue(n: int) -> tuple[list[Block], FreeBlockQueue]:
    blocks = [Block(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_queue_remove_from_the_middle_relinks_only_the_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, queue = make_queue(5)

    # O(1): remove must not walk the list.
    def no_walk(self: FreeBlockQueue) -> None:
        raise AssertionError("remove walked the queue")

    with monkeypatch.context() as m:
        m.setattr(FreeBlockQueue, "__iter__", no_walk)
        m.setattr(FreeBlockQueue, "block_ids", no_walk)
        queue.remove(blocks[2])

    assert queue.block_ids() == [0, 1, 3, 4]
    assert backward_ids(queue) == [0, 1, 3, 4]
    assert len(queue) == 4
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None

    queue.append(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4, 2]
    assert backward_ids(queue) == [0, 1, 3, 4, 2]
    assert len(queue) == 5


def test_queue_remove_first_and_last() -> None:
    blocks, queue = make_queue(4)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queue.block_ids() == [1, 2]
    assert backward_ids(queue) == [1, 2]
    assert len(queue) == 2
    assert queue.popleft() is blocks[1]
    assert queue.popleft() is blocks[2]
    assert queue.block_ids() == []
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_rejects_removing_an_absent_block_and_appending_a_present_one() -> None:
    blocks, queue = make_queue(3)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[0])
    assert queue.block_ids() == [0, 2]
    assert len(queue) == 2


# -- check_integrity -------------------------------------------------------------------------


def test_check_integrity_flags_a_free_block_with_references() -> None:
    pool = BlockPool(4)
    assert pool.allocate(1) is not None
    pool.check_integrity()
    pool.blocks[2].ref_cnt = 1  # in the free queue, yet referenced
    with pytest.raises(AssertionError, match="free but referenced"):
        pool.check_integrity()


def test_check_integrity_flags_a_leaked_block() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) is not None
    pool.blocks[1].ref_cnt = 0  # unreferenced but never returned to the free queue
    with pytest.raises(AssertionError, match=r"free \(2\) \+ referenced \(1\) != total \(4\)"):
        pool.check_integrity()


def test_check_integrity_flags_a_queue_length_out_of_sync() -> None:
    pool = BlockPool(4)
    pool.free_queue._len += 1
    with pytest.raises(AssertionError, match="length out of sync"):
        pool.check_integrity()


def test_check_integrity_flags_a_block_unlinked_behind_the_pools_back() -> None:
    pool = BlockPool(4)
    pool.free_queue.remove(pool.blocks[1])  # gone from the queue, still ref_cnt 0
    with pytest.raises(AssertionError, match=r"free \(3\) \+ referenced \(0\) != total \(4\)"):
        pool.check_integrity()


# -- model-based property --------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 8)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("incref"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(deadline=None, max_examples=200)
@given(num_blocks=st.integers(1, 12), ops=ops)
def test_pool_matches_a_list_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """Free-queue order and ref counts follow a plain list/dict model through any op sequence."""
    pool = BlockPool(num_blocks)
    free: list[int] = list(range(num_blocks))
    refs = [0] * num_blocks
    for op, arg in ops:
        held = [i for i in range(num_blocks) if refs[i] > 0]
        if op == "allocate":
            got = pool.allocate(arg)
            if arg > len(free):
                assert got is None
            else:
                assert got is not None
                assert [b.block_id for b in got] == free[:arg]
                for i in free[:arg]:
                    refs[i] = 1
                free = free[arg:]
        elif op == "free" and held:
            block_id = held[arg % len(held)]
            pool.free([block_id])
            refs[block_id] -= 1
            if refs[block_id] == 0:
                free.append(block_id)
        elif op == "incref" and held:
            block_id = held[arg % len(held)]
            pool.incref([block_id])
            refs[block_id] += 1
        assert pool.free_queue.block_ids() == free
        assert backward_ids(pool.free_queue) == free
        assert ref_counts(pool) == refs
        assert pool.num_free_blocks == len(free)
        pool.check_integrity()
