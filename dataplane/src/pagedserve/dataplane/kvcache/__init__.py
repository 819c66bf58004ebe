"""KV block accounting: the physical block pool, the prefix cache and the per-request block tables (no torch)."""

from pagedserve.common.block_hash import (
    DEFAULT_HASH_SEED,
    BlockHash,
    BlockKey,
    cdiv,
    first_block_extra_keys,
    hash_block_tokens,
    hash_request_blocks,
    seed_hash,
)
from pagedserve.dataplane.kvcache.block_pool import Block, BlockPool, FreeBlockQueue
from pagedserve.dataplane.kvcache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedserve.dataplane.kvcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventRecord,
)

__all__ = [
    "DEFAULT_HASH_SEED",
    "AllBlocksCleared",
    "Block",
    "BlockHash",
    "BlockKey",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheEvent",
    "KVCacheManager",
    "KVEventRecord",
    "PrefixCacheStats",
    "cdiv",
    "first_block_extra_keys",
    "hash_block_tokens",
    "hash_request_blocks",
    "seed_hash",
]
