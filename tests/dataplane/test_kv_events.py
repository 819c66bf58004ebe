"""KV events and the pool's prefix-cache primitives: exact events, sequence numbers, and a
model-based property test in which replaying the events always reproduces the pool's hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.dataplane.kvcache import (
    AllBlocksCleared,
    BlockHash,
    BlockKey,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventRecord,
    seed_hash,
)

ROOT = seed_hash("pagedserve")


def chain(*blocks: tuple[int, ...], parent: BlockHash = ROOT) -> list[tuple[BlockKey, BlockHash]]:
    out = []
    for tokens in blocks:
        key = BlockKey(parent, tokens)
        parent = key.digest()
        out.append((key, parent))
    return out


def cache(
    pool: BlockPool,
    block_ids: list[int],
    links: list[tuple[BlockKey, BlockHash]],
    parent: BlockHash | None = None,
) -> None:
    pool.cache_full_blocks(block_ids, [k for k, _ in links], [h for _, h in links], parent)


def taken_ids(pool: BlockPool, n: int) -> list[int]:
    blocks = pool.allocate(n)
    assert blocks is not None
    return [b.block_id for b in blocks]


def test_sequence_numbers_start_at_one_and_continue_across_drains() -> None:
    pool = BlockPool(4, enable_kv_events=True)
    assert pool.take_events() == []
    (k0, h0), (k1, h1) = chain((1, 2), (3, 4))
    assert taken_ids(pool, 2) == [0, 1]
    cache(pool, [0], [(k0, h0)])
    pool.reset_prefix_cache()
    first = pool.take_events()
    assert first == [
        KVEventRecord(1, BlockStored((h0,), None, (1, 2), 2)),
        KVEventRecord(2, AllBlocksCleared()),
    ]
    assert pool.take_events() == []
    cache(pool, [0, 1], [(k0, h0), (k1, h1)])
    assert pool.take_events() == [KVEventRecord(3, BlockStored((h0, h1), None, (1, 2, 3, 4), 2))]


def test_a_run_is_split_where_a_hash_is_already_cached() -> None:
    pool = BlockPool(6, enable_kv_events=True)
    links = chain((1,), (2,), (3,))
    h = [hh for _, hh in links]
    assert taken_ids(pool, 4) == [0, 1, 2, 3]
    cache(pool, [0], links[1:2], parent=h[0])  # someone already holds the middle block
    pool.take_events()
    cache(pool, [1, 2, 3], links)
    assert [r.event for r in pool.take_events()] == [
        BlockStored((h[0],), None, (1,), 1),
        BlockStored((h[2],), h[1], (3,), 1),  # its parent is the copy held by block 0 / block 2
    ]
    assert pool.num_cached_blocks == 4
    assert pool.cached_block_hashes() == set(h)
    pool.check_integrity()


def test_removed_lists_last_copies_in_eviction_order_one_event_per_allocation() -> None:
    pool = BlockPool(5, enable_kv_events=True)
    links = chain((1,), (2,), (3,))
    h = [hh for _, hh in links]
    assert taken_ids(pool, 4) == [0, 1, 2, 3]
    cache(pool, [0, 1, 2], links)
    cache(pool, [3], links[:1])  # a second copy of h[0]
    pool.take_events()
    pool.free([2, 1, 0])  # tail first
    pool.free([3])
    assert pool.free_queue.block_ids() == [4, 2, 1, 0, 3]
    assert taken_ids(pool, 4) == [4, 2, 1, 0]
    assert [r.event for r in pool.take_events()] == [BlockRemoved((h[2], h[1]))]  # h[0] lives on in 3
    assert taken_ids(pool, 1) == [3]
    assert [r.event for r in pool.take_events()] == [BlockRemoved((h[0],))]
    pool.check_integrity()


def test_cache_full_blocks_rejects_bad_input_and_changes_nothing() -> None:
    pool = BlockPool(4, enable_kv_events=True)
    links = chain((1,), (2,))
    assert taken_ids(pool, 2) == [0, 1]
    with pytest.raises(RuntimeError, match="caching unreferenced"):
        cache(pool, [0, 2], links)
    with pytest.raises(ValueError, match="does not chain"):
        cache(pool, [0, 1], links[::-1])
    with pytest.raises(ValueError, match="does not chain"):
        cache(pool, [0], links[1:], parent=ROOT)
    with pytest.raises(ValueError, match="same length"):
        pool.cache_full_blocks([0, 1], [links[0][0]], [links[0][1]], None)
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == []
    cache(pool, [0], links[:1])
    with pytest.raises(RuntimeError, match="already cached"):
        cache(pool, [1, 0], links)
    assert pool.blocks[1].block_hash is None
    pool.check_integrity()


def test_touch_revives_a_cached_free_block_and_refuses_an_uncached_one() -> None:
    pool = BlockPool(3)
    links = chain((7,))
    assert taken_ids(pool, 1) == [0]
    cache(pool, [0], links)
    pool.free([0])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    block = pool.get_cached_block(links[0][1])
    assert block is pool.blocks[0]
    pool.touch([0])
    pool.touch([0])
    assert pool.blocks[0].ref_cnt == 2
    assert pool.free_queue.block_ids() == [1, 2]
    with pytest.raises(RuntimeError, match="touch on uncached"):
        pool.touch([1])
    assert pool.get_cached_block(chain((8,))[0][1]) is None
    pool.check_integrity()


def test_check_integrity_flags_a_corrupt_cache_map() -> None:
    pool = BlockPool(3)
    links = chain((7,))
    taken_ids(pool, 1)
    cache(pool, [0], links)
    pool.check_integrity()
    pool.blocks[0].block_hash = chain((8,))[0][1]
    with pytest.raises(AssertionError, match="is filed under"):
        pool.check_integrity()
    pool.blocks[0].block_hash = None
    with pytest.raises(AssertionError, match="hash and key out of sync"):
        pool.check_integrity()
    pool.blocks[0].block_hash = links[0][1]
    pool.check_integrity()
    # A block carrying a hash that the map does not file.
    pool.blocks[1].block_hash, pool.blocks[1].block_key = links[0][1], links[0][0]
    with pytest.raises(AssertionError, match="2 blocks carry a hash, the map files 1"):
        pool.check_integrity()


# -- model-based property --------------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 4)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("cache"), st.lists(st.integers(0, 1), min_size=1, max_size=3)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 1), min_size=1, max_size=3)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=60,
)


@settings(deadline=None, max_examples=300)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_pool_with_prefix_cache_matches_a_model(num_blocks: int, ops: list[tuple[str, object]]) -> None:
    """Free-queue order, ref counts, hashes and the exact events follow a plain model; replaying
    the events into a set always gives the pool's cached hashes."""
    pool = BlockPool(num_blocks, enable_kv_events=True)
    free = list(range(num_blocks))
    refs = [0] * num_blocks
    copies: dict[BlockHash, list[int]] = {}  # hash -> block ids, in caching order
    hash_of: dict[int, BlockHash] = {}
    index: set[BlockHash] = set()
    seq = 0
    for op, arg in ops:
        expected: list[KVCacheEvent] = []
        held = [i for i in range(num_blocks) if refs[i] > 0]
        if op == "allocate":
            assert isinstance(arg, int)
            got = pool.allocate(arg)
            if arg > len(free):
                assert got is None
            else:
                assert got is not None and [b.block_id for b in got] == free[:arg]
                removed = []
                for i in free[:arg]:
                    refs[i] = 1
                    if i in hash_of:
                        h = hash_of.pop(i)
                        copies[h].remove(i)
                        if not copies[h]:
                            del copies[h]
                            removed.append(h)
                if removed:
                    expected.append(BlockRemoved(tuple(removed)))
                free = free[arg:]
        elif op == "free" and held:
            assert isinstance(arg, int)
            i = held[arg % len(held)]
            pool.free([i])
            refs[i] -= 1
            if refs[i] == 0:
                free.append(i)
        elif op == "cache":
            assert isinstance(arg, list)
            # A chain of blocks with tokens from {0, 1}: the same chain is often cached twice.
            targets = [i for i in held if i not in hash_of][: len(arg)]
            links = chain(*[(t,) for t in arg[: len(targets)]])
            if not targets:
                continue
            cache(pool, targets, links)
            run: list[BlockHash] = []
            run_parent: BlockHash | None = None
            prev: BlockHash | None = None
            tokens: list[int] = []
            for i, (key, h) in zip(targets, links, strict=True):
                new = h not in copies
                copies.setdefault(h, []).append(i)
                hash_of[i] = h
                if new:
                    if not run:
                        run_parent, tokens = prev, []
                    run.append(h)
                    tokens.extend(key.token_ids)
                elif run:
                    expected.append(BlockStored(tuple(run), run_parent, tuple(tokens), 1))
                    run = []
                prev = h
            if run:
                expected.append(BlockStored(tuple(run), run_parent, tuple(tokens), 1))
        elif op == "touch":
            assert isinstance(arg, list)
            for _, h in chain(*[(t,) for t in arg]):
                block = pool.get_cached_block(h)
                if h not in copies:
                    assert block is None
                    break
                live = [i for i in copies[h] if refs[i] > 0]
                assert block is not None and block.block_id == (live or copies[h])[0]
                pool.touch([block.block_id])
                if refs[block.block_id] == 0:
                    free.remove(block.block_id)
                refs[block.block_id] += 1
        elif op == "reset":
            assert pool.reset_prefix_cache() == len(hash_of)
            copies.clear()
            hash_of.clear()
            expected.append(AllBlocksCleared())

        records = pool.take_events()
        assert [r.event for r in records] == expected
        assert [r.seq for r in records] == list(range(seq + 1, seq + 1 + len(records)))
        seq += len(records)
        for e in expected:
            if isinstance(e, BlockStored):
                index.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                index.difference_update(e.block_hashes)
            else:
                index.clear()
        assert index == pool.cached_block_hashes() == set(copies)
        assert pool.free_queue.block_ids() == free
        assert [b.ref_cnt for b in pool.blocks] == refs
        assert {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None} == hash_of
        assert pool.num_cached_blocks == len(hash_of)
        pool.check_integrity()
