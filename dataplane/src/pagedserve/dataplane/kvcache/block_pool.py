"""The physical KV block pool: block ids, ref counts, the free list and the prefix cache. Imports no torch.

Every block is in exactly one state: free (ref_cnt == 0, no hash), cached-unreferenced
(ref_cnt == 0, carries a hash: evictable) or referenced (ref_cnt >= 1, owned by one or
more block tables, with or without a hash). Free and cached-unreferenced blocks both live
in the free queue, which is therefore the LRU order too: allocation pops its front and
evicts the hash of a cached block it pops; freed blocks join its back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pagedserve.common.block_hash import BlockHash, BlockKey
from pagedserve.dataplane.kvcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventRecord,
)


class Block:
    """One physical block. The links make the free queue intrusive: O(1) removal from its middle."""

    __slots__ = ("block_hash", "block_id", "block_key", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None
        # Set together while the block is in the prefix cache: only full blocks are cached.
        self.block_hash: BlockHash | None = None
        self.block_key: BlockKey | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:12]}"
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front, append at the back, remove anywhere.

    A Python deque cannot remove from its middle in O(1); prefix-cache hits need exactly
    that (a cached free block gets referenced again), so the links live in the blocks.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def append(self, block: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns `num_blocks` blocks and the prefix cache over them.

    Allocation returns None when the request does not fit. The prefix cache maps a block
    hash to the blocks holding it: usually one, more when requests computed the same block
    at the same time (block tables are never remapped, so no copy can be merged away while
    held). With `enable_kv_events` the pool records KV events (kv_events.py); whoever
    enables them must drain `take_events()` regularly.
    """

    def __init__(self, num_blocks: int, enable_kv_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, dict[int, Block]] = {}
        self._num_cached_blocks = 0
        self.enable_kv_events = enable_kv_events
        self._events: list[KVEventRecord] = []
        self._last_seq = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can take: free ones plus cached-unreferenced (evictable) ones."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a hash, referenced or not."""
        return self._num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block] | None:
        """Take `n` blocks from the front of the free queue (ref_cnt becomes 1), or change nothing
        and return None. A cached block taken this way is evicted: its hash is dropped, and
        when no copy of that hash remains a BlockRemoved event says so."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_queue):
            return None
        taken = [self.free_queue.popleft() for _ in range(n)]
        removed: list[BlockHash] = []
        for block in taken:
            if block.block_hash is not None:
                gone = self._uncache(block)
                if gone is not None:
                    removed.append(gone)
            block.ref_cnt = 1
        if removed:
            self._emit(BlockRemoved(tuple(removed)))
        return taken

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (already referenced) block: sharing without copying."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"incref on unreferenced {block}")
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free
        queue, keeping their hash: a cached block stays hittable until it is evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- prefix cache ------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """A block holding `block_hash`, preferring one already referenced (sharing it costs no
        free block), or None. Changes nothing: `touch` commits a hit."""
        copies = self._cached.get(block_hash)
        if not copies:
            return None
        for block in copies.values():
            if block.ref_cnt > 0:
                return block
        return next(iter(copies.values()))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Reference each cached block once more (a prefix-cache hit). An unreferenced one
        leaves the free queue, so it can no longer be evicted."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                raise RuntimeError(f"touch on uncached {block}")
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        keys: Sequence[BlockKey],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Put referenced, newly full blocks into the prefix cache under their hashes.

        `block_ids` are consecutive blocks of one chain, `keys[i]` what `block_hashes[i]`
        covers, and `parent_block_hash` the hash of the block before the first (None when the
        first heads its chain). A hash already cached gains another copy. One BlockStored
        event is recorded per run of hashes new to the pool. Raises, changing nothing, on a
        block that is unreferenced or already cached, or on keys that do not chain.
        """
        if not len(block_ids) == len(keys) == len(block_hashes):
            raise ValueError("block_ids, keys and block_hashes must have the same length")
        prev = parent_block_hash
        for block_id, key, block_hash in zip(block_ids, keys, block_hashes, strict=True):
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise RuntimeError(f"caching unreferenced {block}")
            if block.block_hash is not None:
                raise RuntimeError(f"{block} is already cached")
            if prev is not None and key.parent != prev:
                raise ValueError(f"key of block {block_id} does not chain onto its predecessor")
            prev = block_hash

        run: list[tuple[BlockHash, BlockKey]] = []
        run_parent = prev = parent_block_hash
        for block_id, key, block_hash in zip(block_ids, keys, block_hashes, strict=True):
            block = self.blocks[block_id]
            copies = self._cached.setdefault(block_hash, {})
            is_new = not copies
            copies[block_id] = block
            block.block_hash, block.block_key = block_hash, key
            self._num_cached_blocks += 1
            if is_new:
                if not run:
                    run_parent = prev
                run.append((block_hash, key))
            else:
                self._emit_stored(run, run_parent)
                run = []
            prev = block_hash
        self._emit_stored(run, run_parent)

    def cached_block_hashes(self) -> set[BlockHash]:
        """Every hash the pool holds: what replaying its KV events reproduces."""
        return set(self._cached)

    def reset_prefix_cache(self) -> int:
        """Drop every hash from the prefix cache; return how many blocks carried one.

        Unreferenced cached blocks become plain free blocks, keeping their place in the free
        queue. Referenced ones stay with the requests that hold them, usable as before, but
        can no longer be hit and go back to the pool uncached: no block computed before a
        reset is shared after it (what a weight update needs). Records AllBlocksCleared.
        """
        dropped = self._num_cached_blocks
        for copies in self._cached.values():
            for block in copies.values():
                block.block_hash = None
                block.block_key = None
        self._cached.clear()
        self._num_cached_blocks = 0
        self._emit(AllBlocksCleared())
        return dropped

    def _uncache(self, block: Block) -> BlockHash | None:
        """Drop `block`'s hash; return the hash when that was its last copy."""
        block_hash = block.block_hash
        assert block_hash is not None
        copies = self._cached[block_hash]
        del copies[block.block_id]
        block.block_hash = None
        block.block_key = None
        self._num_cached_blocks -= 1
        if copies:
            return None
        del self._cached[block_hash]
        return block_hash

    # -- events ------------------------------------------------------------------------------
    def take_events(self) -> list[KVEventRecord]:
        """Hand over the events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _emit(self, event: KVCacheEvent) -> None:
        if self.enable_kv_events:
            self._last_seq += 1
            self._events.append(KVEventRecord(self._last_seq, event))

    def _emit_stored(self, run: list[tuple[BlockHash, BlockKey]], parent: BlockHash | None) -> None:
        if run:
            tokens = tuple(t for _, key in run for t in key.token_ids)
            self._emit(BlockStored(tuple(h for h, _ in run), parent, tokens, len(run[0][1].token_ids)))

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and the free queue
        and the prefix-cache map agree with the blocks."""
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == len(self.free_queue), "free queue length out of sync"
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        for block_id in free_ids:
            assert self.blocks[block_id].ref_cnt == 0, f"{self.blocks[block_id]} is free but referenced"
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert referenced + len(free_ids) == self.num_blocks, (
            f"free ({len(free_ids)}) + referenced ({referenced}) != total ({self.num_blocks})"
        )
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative ref count"
            if b.ref_cnt > 0:
                assert b.prev_free is None and b.next_free is None, f"{b} is referenced but linked"
            assert (b.block_hash is None) == (b.block_key is None), f"{b}: hash and key out of sync"

        in_map = 0
        for block_hash, copies in self._cached.items():
            assert copies, f"hash {block_hash.hex()} maps to no block"
            for block_id, block in copies.items():
                assert block is self.blocks[block_id], f"hash map entry {block_id} is a stranger"
                assert block.block_hash == block_hash, f"{block} is filed under {block_hash.hex()[:12]}"
            in_map += len(copies)
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == in_map == self._num_cached_blocks, (
            f"{hashed} blocks carry a hash, the map files {in_map}, the count says {self._num_cached_blocks}"
        )
