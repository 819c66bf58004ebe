"""Maps requests' logical blocks onto the pool's physical blocks, with prefix caching, and swaps
them to a host-side pool and back. Imports no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.block_hash import (
    DEFAULT_HASH_SEED,
    BlockHash,
    BlockKey,
    block_keys,
    cdiv,
    first_block_extra_keys,
    seed_hash,
)
from pagedserve.dataplane.kvcache.block_pool import BlockPool
from pagedserve.dataplane.kvcache.kv_events import KVEventRecord
from pagedserve.dataplane.request import Request


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

    With a `host_pool` (the same block accounting over the swap space: its own free list,
    never a prefix cache) a running request can be preempted by swap: `swap_out` moves its
    block table to host blocks and `swap_in` back to device blocks, each returning the
    (source, destination) block copies the model runner must make before the step's forward,
    the swap-outs of a step before its swap-ins. This manager only does the accounting.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: str = DEFAULT_HASH_SEED,
        host_pool: BlockPool | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if host_pool is not None and host_pool is pool:
            raise ValueError("the host pool must be a pool of its own")
        self.pool = pool
        self.host_pool = host_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._root = seed_hash(hash_seed)
        self.prefix_cache_stats = PrefixCacheStats()
        # Requests holding blocks, and how many of each one's leading blocks are cached.
        self._held: dict[str, Request] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Requests swapped out: holding host blocks, no device blocks.
        self._swapped: dict[str, Request] = {}

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

        No hits for a request asking for prompt logprobs (or mean / cls pooling): those need
        every prompt position computed. Capped at `compute_end - 1` tokens (`num_tokens - 1` but for a sample whose first
        token was drawn before its prompt was computed: its prompt's) so at least one token is
        computed and yields logits: a last full block the cap cuts into is not a hit. Each hit is verified by
        its key (parent hash, tokens, extra keys), not just its hash. Changes nothing in the
        pool; `allocate_slots(..., new_computed_blocks=...)` commits the hit.
        """
        if request.block_table:
            raise ValueError(f"{request} already holds blocks")
        if request.computes_every_prompt_row:
            # Its prompt logprobs (or mean / cls pooling) come from computing every prompt
            # position (vLLM's choice); it still caches its blocks for others.
            return [], 0
        hit = self._cached_prefix(request, (request.compute_end - 1) // self.block_size)
        return hit, len(hit) * self.block_size

    def _cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """The device blocks caching the request's leading full blocks, at most `max_blocks`."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        hashes = self.block_hashes(request)
        hit: list[int] = []
        for index in range(min(max_blocks, len(hashes))):
            block = self.pool.get_cached_block(hashes[index])
            if block is None or block.block_key != self._block_key(request, index):
                break
            hit.append(block.block_id)
        return hit

    def num_shared_prefix_blocks(self, request: Request) -> int:
        """How many of the running request's leading blocks are cached and also held by another
        request: they would survive its preemption, so a recompute would find them (at most
        the blocks `get_computed_blocks` may return)."""
        if not self.enable_prefix_caching or request.computes_every_prompt_row:
            return 0
        limit = min(len(request.block_table), (request.compute_end - 1) // self.block_size)
        n = 0
        for block_id in request.block_table[:limit]:
            block = self.pool.blocks[block_id]
            if block.block_hash is None or block.ref_cnt < 2:
                break
            n += 1
        return n

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
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        *,
        reserve: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` for a request
        holding no blocks: on success they are referenced, head its block table, and its
        `num_computed_tokens` moves past them. Returns the newly allocated block ids
        (possibly empty), or None, changing nothing, when the pool has too few free blocks;
        hits on unreferenced cached blocks count against the free blocks too, since
        referencing them takes them out of the free queue. `reserve` free blocks must remain
        afterwards (the scheduler's watermark).
        """
        if request.host_block_table:
            raise ValueError(f"{request} is swapped out: swap it in first")
        if new_computed_blocks and (request.block_table or request.num_computed_tokens):
            raise ValueError(f"prefix-cache hits for {request}, which has already started")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        needed = max(0, self.num_blocks_for(total) - len(request.block_table) - len(new_computed_blocks))
        evictable_hits = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if needed + evictable_hits + reserve > self.pool.num_free_blocks:
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

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks of `request` beyond those its first `num_tokens` tokens need: blocks
        `allocate_slots` gave it for a step it was then taken out of (a priority preemption),
        never written, never cached."""
        keep = self.num_blocks_for(num_tokens)
        tail = request.block_table[keep:]
        if tail:
            self.pool.free(reversed(tail))
            del request.block_table[keep:]

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
        """Release every block of `request`, device and host; both its tables become empty.

        Freed in reverse so the tail of a chain is evicted before its head: a cached block
        is only useful while its parents are.
        """
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        self._held.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if request.host_block_table:
            assert self.host_pool is not None
            self.host_pool.free(reversed(request.host_block_table))
            request.host_block_table = []
        self._swapped.pop(request.request_id, None)

    # -- swapping ----------------------------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move every block of the running `request` to the host pool; return the
        (device block, host block) copies to make, or None, changing nothing, when the host
        pool has too few free blocks (or there is none).

        Its device blocks are freed at once (reversed, like `free`; cached ones stay
        hittable), so the copies must run before anything writes into them: before the
        step's forward. Its computed tokens are kept.
        """
        if self.host_pool is None or not request.block_table:
            return None
        if request.host_block_table:
            raise ValueError(f"{request} is already swapped out")
        taken = self.host_pool.allocate(len(request.block_table))
        if taken is None:
            return None
        host_ids = [b.block_id for b in taken]
        pairs = list(zip(request.block_table, host_ids, strict=True))
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        request.host_block_table = host_ids
        self._held.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._swapped[request.request_id] = request
        return pairs

    def swap_in(
        self, request: Request, num_new_tokens: int, *, reserve: int = 0
    ) -> list[tuple[int, int]] | None:
        """Give the swapped-out `request` device blocks for its computed tokens plus
        `num_new_tokens` more; return the (host block, device block) copies to make, or None,
        changing nothing, when the device pool cannot spare them (keeping `reserve` free).

        Leading full blocks still in the prefix cache are shared rather than copied (a
        sibling or an identical prompt kept them). The host blocks are freed at once: the
        copies must run before the next swap-out can reuse them (before the next schedule).
        """
        if request.block_table or not request.host_block_table:
            raise ValueError(f"{request} is not swapped out")
        computed = request.num_computed_tokens
        num_host = len(request.host_block_table)
        hits = self._cached_prefix(request, min(computed // self.block_size, num_host))
        needed = self.num_blocks_for(computed + num_new_tokens) - len(hits)
        evictable_hits = sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)
        if needed + evictable_hits + reserve > self.pool.num_free_blocks:
            return None
        # Reference the hits before allocating, or allocation could evict them.
        self.pool.touch(hits)
        blocks = self.pool.allocate(needed)
        assert blocks is not None, "free blocks were counted above"
        request.block_table = hits + [b.block_id for b in blocks]
        pairs = [(request.host_block_table[i], request.block_table[i]) for i in range(len(hits), num_host)]
        assert self.host_pool is not None
        self.host_pool.free(reversed(request.host_block_table))
        request.host_block_table = []
        del self._swapped[request.request_id]
        self._held[request.request_id] = request
        if hits:
            self._num_cached_blocks[request.request_id] = len(hits)
        return pairs

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for request_id, n in self._num_cached_blocks.items():
            request = self._held.get(request_id)
            assert request is not None, f"cached-block count kept for {request_id!r}, which holds no blocks"
            assert n <= len(request.block_table), f"{request} has {n} cached blocks"
        for request in self._held.values():
            assert request.block_table, f"{request} is held without blocks"
            assert not request.host_block_table, f"{request} holds device and host blocks"
            assert request.num_computed_tokens <= len(request.block_table) * self.block_size
        if self.host_pool is None:
            assert not self._swapped, "requests swapped out without a host pool"
            return
        self.host_pool.check_integrity()
        assert self.host_pool.num_cached_blocks == 0, "the host pool caches no prefixes"
        held = 0
        for request_id, request in self._swapped.items():
            assert request_id not in self._held, f"{request} is swapped out and held"
            assert request.host_block_table and not request.block_table, f"{request} is not swapped out"
            assert request.num_computed_tokens <= len(request.host_block_table) * self.block_size
            for block_id in request.host_block_table:
                assert self.host_pool.blocks[block_id].ref_cnt == 1, f"host block {block_id} is shared"
            held += len(request.host_block_table)
        assert held == self.host_pool.num_used_blocks, (
            f"swapped-out requests hold {held} host blocks but {self.host_pool.num_used_blocks} are in use"
        )
