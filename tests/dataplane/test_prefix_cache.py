"""Automatic prefix caching on tiny pools: exact block ids, ref counts, hashes, eviction order,
events and counters after scripted sequences."""

from __future__ import annotations

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import (
    AllBlocksCleared,
    BlockHash,
    BlockKey,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVCacheManager,
    hash_request_blocks,
)
from pagedserve.dataplane.scheduler import Request, Scheduler

BS = 4
SEED = "pagedserve"
SYSTEM = [901, 902, 903, 904, 905, 906, 907, 908]  # two full blocks of a shared system prompt


class RecordingPool(BlockPool):
    """A pool whose events are drained by tests, checking the sequence numbers never skip."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, enable_kv_events=True)
        self.last_seq = 0

    def drain(self) -> list[KVCacheEvent]:
        records = self.take_events()
        assert [r.seq for r in records] == list(range(self.last_seq + 1, self.last_seq + 1 + len(records)))
        self.last_seq += len(records)
        return [r.event for r in records]


def make(num_blocks: int, **kwargs: object) -> tuple[RecordingPool, KVCacheManager]:
    pool = RecordingPool(num_blocks)
    return pool, KVCacheManager(pool, BS, **kwargs)  # type: ignore[arg-type]


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def hashes(tokens: list[int], salt: str | None = None) -> list[BlockHash]:
    return hash_request_blocks(tokens, BS, SEED, [] if salt is None else [f"salt:{salt}"])


def prefill(kv: KVCacheManager, r: Request) -> tuple[list[int], list[int]]:
    """Admit `r` like the scheduler does and compute its whole prompt; (hit ids, new ids)."""
    hit, num_hit_tokens = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_hit_tokens, new_computed_blocks=hit)
    assert new is not None
    assert r.num_computed_tokens == num_hit_tokens
    compute(kv, r, r.num_tokens - num_hit_tokens)
    return hit, new


def compute(kv: KVCacheManager, r: Request, n: int) -> None:
    """A model step computed `n` more tokens of `r` (already allocated)."""
    r.num_computed_tokens += n
    kv.cache_blocks(r, r.num_computed_tokens)
    kv.check_integrity()


def decode(kv: KVCacheManager, r: Request, token: int) -> None:
    r.append_output_token(token)
    assert kv.allocate_slots(r, 1) is not None
    compute(kv, r, 1)


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def events(pool: RecordingPool) -> list[KVCacheEvent]:
    return pool.drain()


# -- sharing ---------------------------------------------------------------------------------


def test_shared_system_prompt() -> None:
    pool, kv = make(8)
    a = req("a", [*SYSTEM, 11, 12, 13])
    b = req("b", [*SYSTEM, 21, 22, 23, 24, 25])
    h_sys = hashes(SYSTEM)

    assert prefill(kv, a) == ([], [0, 1, 2])
    assert [pool.blocks[i].block_hash for i in (0, 1, 2)] == [*h_sys, None]  # 2 is partial
    assert events(pool) == [BlockStored(tuple(h_sys), None, tuple(SYSTEM), BS)]

    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert prefill(kv, b) == ([0, 1], [3, 4])
    assert b.block_table == [0, 1, 3, 4]
    assert (b.num_computed_tokens, b.num_cached_tokens, a.num_cached_tokens) == (13, 8, 0)
    assert refs(pool) == [2, 2, 1, 1, 1, 0, 0, 0]
    b_hashes = hashes(b.prompt_token_ids)
    assert b_hashes[:2] == h_sys
    assert pool.blocks[3].block_hash == b_hashes[2]
    assert events(pool) == [BlockStored((b_hashes[2],), h_sys[1], (21, 22, 23, 24), BS)]

    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits, stats.short_prompt_requests) == (2, 24, 8, 0)
    assert stats.hit_rate == 8 / 24
    # Token usage counts each physical slot once: a's 11 + b's 5 unshared tokens.
    assert pool.num_used_blocks == 5
    assert kv.num_used_tokens == 16
    assert kv.token_usage == 16 / 32
    assert kv.usage == 5 / 8

    kv.free(a)
    assert refs(pool) == [1, 1, 0, 1, 1, 0, 0, 0]
    assert pool.free_queue.block_ids() == [5, 6, 7, 2]
    assert kv.num_used_tokens == 13
    kv.free(b)
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 4, 3, 1, 0]
    assert refs(pool) == [0] * 8
    assert pool.cached_block_hashes() == {*h_sys, b_hashes[2]}
    assert events(pool) == []  # freeing never removes anything from the cache
    kv.check_integrity()


def test_divergence_mid_block_shares_only_the_blocks_before_it() -> None:
    pool, kv = make(8)
    a = req("a", list(range(10)))
    b = req("b", [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10])  # differs at token 6, inside block 1
    prefill(kv, a)
    assert kv.get_computed_blocks(b) == ([0], 4)
    assert prefill(kv, b) == ([0], [3, 4])
    assert refs(pool) == [2, 1, 1, 1, 1, 0, 0, 0]
    assert pool.blocks[3].block_hash == hashes(b.prompt_token_ids)[1] != pool.blocks[1].block_hash


def test_a_hit_leaves_at_least_one_token_to_compute() -> None:
    pool, kv = make(8)
    a = req("a", SYSTEM)  # exactly two full blocks
    prefill(kv, a)
    assert pool.cached_block_hashes() == set(hashes(SYSTEM))

    # The same two blocks: only the first is a hit; the last block's 4 tokens are computed.
    b = req("b", SYSTEM)
    assert kv.get_computed_blocks(b) == ([0], 4)
    assert prefill(kv, b) == ([0], [2])
    # One token more: both blocks are hits and just that token is computed.
    c = req("c", [*SYSTEM, 909])
    assert kv.get_computed_blocks(c) == ([0, 1], 8)
    # A prompt inside the first block has nothing to hit.
    assert kv.get_computed_blocks(req("d", SYSTEM[:3])) == ([], 0)
    assert kv.get_computed_blocks(req("e", SYSTEM[:4])) == ([], 0)
    assert kv.get_computed_blocks(req("f", SYSTEM[:5])) == ([0], 4)


def test_duplicates_share_one_hash_and_removal_waits_for_the_last_copy() -> None:
    pool, kv = make(6)
    a, b = req("a", SYSTEM), req("b", SYSTEM)
    # Both admitted before either computed anything: nothing to hit, separate blocks.
    for r in (a, b):
        hit, n = kv.get_computed_blocks(r)
        assert (hit, n) == ([], 0)
        assert kv.allocate_slots(r, 8, new_computed_blocks=hit) is not None
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    compute(kv, a, 8)
    compute(kv, b, 8)
    h = hashes(SYSTEM)
    assert [pool.blocks[i].block_hash for i in range(4)] == [h[0], h[1], h[0], h[1]]
    assert events(pool) == [BlockStored(tuple(h), None, tuple(SYSTEM), BS)]  # once, for a
    assert pool.num_cached_blocks == 4
    assert pool.cached_block_hashes() == set(h)

    kv.free(a)  # a's copies become evictable; b's stay referenced
    assert pool.free_queue.block_ids() == [4, 5, 1, 0]
    # A hit prefers the referenced copy: it costs no free block.
    assert pool.get_cached_block(h[0]) is pool.blocks[2]
    assert pool.allocate(4) is not None  # evicts 1 and 0: b still holds both hashes
    assert events(pool) == []
    assert pool.num_cached_blocks == 2
    pool.free([4, 5, 1, 0])

    kv.free(b)
    assert pool.free_queue.block_ids() == [4, 5, 1, 0, 3, 2]
    taken = pool.allocate(6)
    assert taken is not None
    assert [blk.block_id for blk in taken] == [4, 5, 1, 0, 3, 2]
    # The last copies go: tail before head.
    assert events(pool) == [BlockRemoved((h[1], h[0]))]
    assert pool.cached_block_hashes() == set()
    pool.check_integrity()


# -- eviction --------------------------------------------------------------------------------


def test_eviction_under_pressure_is_lru_and_tails_go_before_heads() -> None:
    pool, kv = make(6)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = req("b", [11, 12, 13, 14, 15, 16, 17, 18, 19])
    ha, hb = hashes(a.prompt_token_ids), hashes(b.prompt_token_ids)
    assert prefill(kv, a) == ([], [0, 1, 2])
    assert prefill(kv, b) == ([], [3, 4, 5])
    events(pool)
    kv.free(a)
    kv.free(b)
    # Least recently freed last; inside a request, tail first. 2 and 5 are partial, uncached.
    assert pool.free_queue.block_ids() == [2, 1, 0, 5, 4, 3]
    assert pool.num_cached_blocks == 4

    c = req("c", [31, 32, 33, 34, 35, 36, 37, 38])
    assert prefill(kv, c) == ([], [2, 1])  # evicts a's tail block 1, not its head 0
    assert events(pool) == [
        BlockRemoved((ha[1],)),
        BlockStored(tuple(hashes(c.prompt_token_ids)), None, tuple(c.prompt_token_ids), BS),
    ]
    assert pool.free_queue.block_ids() == [0, 5, 4, 3]

    # a again: its head survived, so one block is a hit; its other blocks evict b's tail.
    a2 = req("a2", a.prompt_token_ids)
    assert prefill(kv, a2) == ([0], [5, 4])
    assert refs(pool) == [1, 1, 1, 0, 1, 1]
    assert events(pool) == [BlockRemoved((hb[1],)), BlockStored((ha[1],), ha[0], (5, 6, 7, 8), BS)]
    assert pool.free_queue.block_ids() == [3]
    assert pool.cached_block_hashes() == {ha[0], ha[1], hb[0], *hashes(c.prompt_token_ids)}
    kv.check_integrity()


def test_hits_on_evictable_blocks_count_against_the_free_blocks() -> None:
    pool, kv = make(3)
    a = req("a", [1, 2, 3, 4, 5])
    prefill(kv, a)
    kv.free(a)
    other = req("other", [70])
    assert prefill(kv, other) == ([], [2])
    assert pool.free_queue.block_ids() == [1, 0]
    events(pool)

    # b hits block 0 (evictable) and needs 2 new blocks for tokens 4..8: 3 of the 2 free.
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([0], 4)
    assert kv.allocate_slots(b, b.num_tokens - n, new_computed_blocks=hit) is None
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == ([], 0, 0)
    assert refs(pool) == [0, 0, 1]
    assert pool.free_queue.block_ids() == [1, 0]
    assert pool.blocks[0].block_hash is not None
    assert kv.prefix_cache_stats.requests == 2  # a refused admission is not counted
    assert events(pool) == []

    # Computing fewer tokens fits: the hit plus one new block.
    assert kv.allocate_slots(b, 4, new_computed_blocks=hit) == [1]
    assert (b.block_table, b.num_computed_tokens) == ([0, 1], 4)
    assert refs(pool) == [1, 1, 1]
    assert kv.prefix_cache_stats.requests == 3
    kv.check_integrity()


# -- isolation, verification, reset ----------------------------------------------------------


def test_salt_isolation() -> None:
    pool, kv = make(12)
    a = req("a", [*SYSTEM, 1], salt="tenant-a")
    prefill(kv, a)
    assert [pool.blocks[i].block_hash for i in (0, 1)] == hashes(SYSTEM, "tenant-a")
    assert set(hashes(SYSTEM, "tenant-a")).isdisjoint(hashes(SYSTEM))

    assert kv.get_computed_blocks(req("b", [*SYSTEM, 1], salt="tenant-b")) == ([], 0)
    assert kv.get_computed_blocks(req("c", [*SYSTEM, 1])) == ([], 0)
    assert kv.get_computed_blocks(req("d", [*SYSTEM, 1], salt="tenant-a")) == ([0, 1], 8)

    unsalted = req("e", [*SYSTEM, 2])
    assert prefill(kv, unsalted) == ([], [3, 4, 5])
    assert kv.get_computed_blocks(req("f", [*SYSTEM, 3])) == ([3, 4], 8)
    assert kv.get_computed_blocks(req("g", [*SYSTEM, 3], salt="tenant-b")) == ([], 0)


def test_salt_must_be_a_non_empty_string() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        req("a", [1], salt="")


def test_a_hit_is_verified_against_the_blocks_key() -> None:
    pool, kv = make(8)
    prefill(kv, req("a", [*SYSTEM, 1]))
    # Forge a collision: block 1 is filed under the right hash but holds other tokens.
    key = pool.blocks[1].block_key
    assert key is not None
    pool.blocks[1].block_key = BlockKey(key.parent, (0, 0, 0, 0), key.extra_keys)
    assert kv.get_computed_blocks(req("b", [*SYSTEM, 1])) == ([0], 4)


def test_reset_drops_cached_blocks_and_keeps_referenced_ones_usable() -> None:
    pool, kv = make(8)
    a = req("a", [*SYSTEM, 1])
    b = req("b", [41, 42, 43, 44, 45])
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)
    events(pool)
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 1, 0]
    assert pool.num_cached_blocks == 3

    assert kv.reset_prefix_cache() == 3
    assert events(pool) == [AllBlocksCleared()]
    assert pool.cached_block_hashes() == set()
    assert all(blk.block_hash is None and blk.block_key is None for blk in pool.blocks)
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 1, 0]  # LRU order kept
    assert refs(pool) == [0, 0, 0, 1, 1, 0, 0, 0]
    assert kv.get_computed_blocks(req("a2", [*SYSTEM, 1])) == ([], 0)

    # b keeps its blocks and grows; a block it fills after the reset is cached as usual,
    # the ones from before are not re-announced.
    assert b.block_table == [3, 4]
    for token in (46, 47, 48):
        decode(kv, b, token)
    assert b.block_table == [3, 4]
    stored = events(pool)
    assert stored == [
        BlockStored((hashes(b.all_token_ids)[1],), hashes(b.all_token_ids)[0], (45, 46, 47, 48), BS)
    ]
    assert kv.get_computed_blocks(req("b2", [41, 42, 43, 44, 45, 46, 47, 48, 49])) == ([], 0)
    kv.free(b)
    assert events(pool) == []
    kv.check_integrity()


# -- counters and switches -------------------------------------------------------------------


def test_counters_tell_short_prompts_and_preempted_requests_apart() -> None:
    _pool, kv = make(8)
    prefill(kv, req("short", [1, 2, 3]))
    a = req("a", [*SYSTEM, 1, 2])
    prefill(kv, a)
    b = req("b", [*SYSTEM, 3])
    prefill(kv, b)
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits, stats.short_prompt_requests) == (3, 3 + 10 + 9, 8, 1)
    assert stats.hit_rate == 8 / 22

    # b is preempted (as the scheduler does it) and resumes from its own cached blocks.
    kv.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions += 1
    assert b.block_table == []
    assert prefill(kv, b) == ([1, 2], [5])  # "short" holds block 0
    assert (stats.requests, stats.queries, stats.hits) == (3, 22, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert b.num_cached_tokens == 8  # from its first admission


def test_prefix_caching_off() -> None:
    pool, kv = make(8, enable_prefix_caching=False)
    prefill(kv, req("a", [*SYSTEM, 1]))
    b = req("b", [*SYSTEM, 1])
    assert kv.get_computed_blocks(b) == ([], 0)
    assert prefill(kv, b) == ([], [3, 4, 5])
    assert pool.num_cached_blocks == 0
    assert events(pool) == []
    assert kv.prefix_cache_stats.requests == 0
    assert b.block_hashes == []


def test_events_are_not_recorded_unless_enabled() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    prefill(kv, req("a", [*SYSTEM, 1]))
    assert pool.num_cached_blocks == 2
    kv.reset_prefix_cache()
    assert pool.take_events() == []


def test_get_computed_blocks_refuses_a_request_that_holds_blocks() -> None:
    _, kv = make(4)
    a = req("a", [1, 2])
    prefill(kv, a)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.get_computed_blocks(a)


# -- through the scheduler -------------------------------------------------------------------


def test_scheduler_reuses_a_finished_requests_prompt_and_caches_decoded_blocks() -> None:
    pool = BlockPool(8, enable_kv_events=True)
    s = Scheduler(
        KVCacheManager(pool, BS),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, watermark=0.0),
        64,
    )
    a = req("a", [*SYSTEM, 1])
    s.add_request(a)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 9)]
    # Blocks enter the cache only once the step's output says their KV is written.
    assert pool.num_cached_blocks == 0
    s.update_from_output(out, {"a": 2})
    assert pool.num_cached_blocks == 2
    for token in (3, 4):
        s.update_from_output(s.schedule(), {"a": token})
    # a = SYSTEM + [1, 2, 3, 4]: block 2 is full of tokens, but 4 is sampled, not computed yet.
    assert (a.block_table, a.num_computed_tokens) == ([0, 1, 2], 11)
    assert pool.blocks[2].block_hash is None
    s.update_from_output(s.schedule(), {"a": 5})
    assert (a.block_table, a.num_computed_tokens) == ([0, 1, 2], 12)
    assert pool.blocks[2].block_hash == hashes(a.all_token_ids)[2]

    b = req("b", [*SYSTEM, 1, 2, 3, 4, 5])
    s.add_request(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("a", 1, True),
        ("b", 1, True),
    ]
    assert b.block_table == [0, 1, 2, 4]
    assert b.num_cached_tokens == 12
    assert [blk.ref_cnt for blk in pool.blocks[:5]] == [2, 2, 2, 1, 1]
    s.update_from_output(out, {"a": 5, "b": 6})
    s.check_integrity()
