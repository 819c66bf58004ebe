"""KV block accounting: the physical block pool, the prefix cache and the per-request block tables (no torch)."""

from dataplane.kvcache.block_pool import Block, BlockPool, FreeBlockQueue
from dataplane.kvcache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from dataplane.kvcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventRecord,
)
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
