"""Maps requests' logical blocks onto the pool's physical blocks, with prefix caching. Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dataplane.kvcache.block_pool import BlockPool
from dataplane.kvcache.kv_events import KVEventRecord
from dataplane.request import Request
from pagedserve.common.block_hash import (
    DEFAULT_HASH_SEED,
    BlockHash,
    BlockKey,
    block_keys,
    cdiv,
    first_block_extra_keys,
    seed_hash,
)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, counted when an admission commits (never for a
    lookup whose allocation did not fit, so a request that waits is not counted twice).

    `queries` and `hits` are tokens: at a first admission, the request's tokens and those of
    them served from the cache. Re-admissions after preemption count in the `preempted_*`
    fields instead, so the hit rate describes what clients sent. `short_prompt_requests`
    counts first admissions whose prompt is shorter than one block: nothing cacheable, as
    opposed to cacheable but missed.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    short_prompt_requests: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries over first admissions, 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Grows and releases the block tables that requests own, reusing cached prefix blocks.

    Allocation is query-then-commit: `allocate_slots` either appends every block the
    request needs to its table or changes nothing and returns None. With prefix caching,
    `get_computed_blocks` finds a new request's cached leading blocks (changing nothing),
    `allocate_slots(..., new_computed_blocks=...)` commits them, and `cache_blocks` files
    each block that a step filled under its chained hash.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: str = DEFAULT_HASH_SEED,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._root = seed_hash(hash_seed)
        self.prefix_cache_stats = PrefixCacheStats()
        # Requests holding blocks, and how many of each one's leading blocks are cached.
        self._held: dict[str, Request] = {}
        self._num_cached_blocks: dict[str, int] = {}

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return self.pool.usage

    @property
    def num_used_tokens(self) -> int:
        """Slots of referenced blocks that hold computed tokens, each physical slot once.

        Shared blocks are always full, so the unfilled slots are the tails of each holder's
        own last blocks (including slots reserved for tokens a step has yet to compute).
        """
        slack = sum(len(r.block_table) * self.block_size - r.num_computed_tokens for r in self._held.values())
        return self.pool.num_used_blocks * self.block_size - slack

    @property
    def token_usage(self) -> float:
        """Fraction of the pool's token slots holding computed tokens, in [0, 1]."""
        return self.num_used_tokens / (self.pool.num_blocks * self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- prefix cache ------------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended to its current tokens.

        Kept on the request: its tokens only grow, so they stay valid across preemption.
        """
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extras = first_block_extra_keys(request.cache_salt)
            new = block_keys(request.all_token_ids, self.block_size, self._root, extras, request.block_hashes)
            request.block_hashes.extend(h for _, h in new)
        return request.block_hashes

    def _block_key(self, request: Request, index: int) -> BlockKey:
        """What the hash of the request's block `index` covers (its hashes reach that far)."""
        parent = request.block_hashes[index - 1] if index else self._root
        tokens = tuple(request.all_token_ids[index * self.block_size : (index + 1) * self.block_size])
        return BlockKey(parent, tokens, first_block_extra_keys(request.cache_salt) if index == 0 else ())

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks that starts the request's tokens, as
        (block ids, tokens they hold).

        Capped at `num_tokens - 1` tokens so at least one token is computed and yields
        logits: a last full block the cap cuts into is not a hit. Each hit is verified by
        its key (parent hash, tokens, extra keys), not just its hash. Changes nothing in the
        pool; `allocate_slots(..., new_computed_blocks=...)` commits the hit.
        """
        if request.block_table:
            raise ValueError(f"{request} already holds blocks")
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.block_hashes(request)
        hit: list[int] = []
        for index in range((request.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(hashes[index])
            if block is None or block.block_key != self._block_key(request, index):
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Note that `request` has `num_computed_tokens` computed tokens, their KV written:
        blocks that became full enter the prefix cache (BlockStored for new hashes).

        Call after every step that computed tokens of the request.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_table))
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self.block_hashes(request)
        self.pool.cache_full_blocks(
            request.block_table[done:num_full],
            [self._block_key(request, i) for i in range(done, num_full)],
            hashes[done:num_full],
            hashes[done - 1] if done else None,
        )
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (see BlockPool.reset_prefix_cache); returns how many carried a hash."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEventRecord]:
        return self.pool.take_events()

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` for a request
        holding no blocks: on success they are referenced, head its block table, and its
        `num_computed_tokens` moves past them. Returns the newly allocated block ids
        (possibly empty), or None, changing nothing, when the pool has too few free blocks;
        hits on unreferenced cached blocks count against the free blocks too, since
        referencing them takes them out of the free queue.
        """
        if new_computed_blocks and (request.block_table or request.num_computed_tokens):
            raise ValueError(f"prefix-cache hits for {request}, which has already started")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        needed = max(0, self.num_blocks_for(total) - len(request.block_table) - len(new_computed_blocks))
        evictable_hits = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if needed + evictable_hits > self.pool.num_free_blocks:
            return None

        admitted = not request.block_table
        if new_computed_blocks:
            # Reference the hits before allocating, or allocation could evict them.
            self.pool.touch(new_computed_blocks)
            request.block_table.extend(new_computed_blocks)
            request.num_computed_tokens = num_hit_tokens
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        blocks = self.pool.allocate(needed)
        assert blocks is not None, "free blocks were counted above"
        new_ids = [b.block_id for b in blocks]
        request.block_table.extend(new_ids)
        if admitted and request.block_table:
            self._held[request.request_id] = request
            self._record_admission(request, num_hit_tokens)
        return new_ids

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        stats = self.prefix_cache_stats
        if request.num_preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
            return
        request.num_cached_tokens = num_hit_tokens
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        if request.num_prompt_tokens < self.block_size:
            stats.short_prompt_requests += 1

    def free(self, request: Request) -> None:
        """Release every block of `request`; its block table becomes empty.

        Freed in reverse so the tail of a chain is evicted before its head: a cached block
        is only useful while its parents are.
        """
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        self._held.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for request_id, n in self._num_cached_blocks.items():
            request = self._held.get(request_id)
            assert request is not None, f"cached-block count kept for {request_id!r}, which holds no blocks"
            assert n <= len(request.block_table), f"{request} has {n} cached blocks"
        for request in self._held.values():
            assert request.block_table, f"{request} is held without blocks"
            assert request.num_computed_tokens <= len(request.block_table) * self.block_size
