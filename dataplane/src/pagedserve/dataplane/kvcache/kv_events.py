"""KV-cache events: what an external prefix index needs to follow one block pool. Imports no torch.

The events describe the *set of block hashes* the pool holds: `BlockStored` when a hash
first appears, `BlockRemoved` when its last copy is evicted, `AllBlocksCleared` when the
prefix cache is reset. Replaying them in sequence order into a set reproduces
`BlockPool.cached_block_hashes()`. Duplicate copies of a hash (two requests that computed
the same block at once) are invisible here: they add nothing an index can route on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """A run of consecutive blocks of one chain became cached.

    `parent_block_hash` is the hash of the block before the first one (None when the first
    one heads its chain); `token_ids` holds the run's tokens, `block_size` per block.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class BlockRemoved:
    """No block with any of these hashes remains in the pool (in eviction order)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: the pool holds no hash any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventRecord:
    """One event and its sequence number: 1, 2, 3, ... per pool, with no gaps."""

    seq: int
    event: KVCacheEvent
