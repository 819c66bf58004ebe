"""KV block accounting: the physical block pool and the per-request block tables (no torch)."""

from dataplane.kvcache.block_pool import Block, BlockPool, FreeBlockQueue
from dataplane.kvcache.kv_cache_manager import KVCacheManager, cdiv

__all__ = ["Block", "BlockPool", "FreeBlockQueue", "KVCacheManager", "cdiv"]
