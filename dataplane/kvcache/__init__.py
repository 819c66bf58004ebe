"""KV block accounting: the physical block pool, the prefix cache and the per-request block tables (no torch)."""

from dataplane.kvcache.block_hash import (
    BlockHash,
    BlockKey,
    first_block_extra_keys,
    hash_block_tokens,
    hash_request_blocks,
    seed_hash,
)
from dataplane.kvcache.block_pool import Block, BlockPool, FreeBlockQueue
from dataplane.kvcache.kv_cache_manager import DEFAULT_HASH_SEED, KVCacheManager, PrefixCacheStats, cdiv
from dataplane.kvcache.kv_events import (
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
