"""Paged KV cache ops: metadata, cache writes/copies and paged attention.

These are the torch reference implementations, the default on CPU. Triton implementations
come later behind the same API (same signatures, same AttentionMetadata). This package is a
leaf: it imports only torch (and numpy for host-side metadata), never dataplane/controlplane.
"""

from kernels.attention import paged_attention
from kernels.cache_ops import copy_blocks, write_kv_cache
from kernels.metadata import AttentionMetadata, DecodeGroup, PrefillSeq, build_attention_metadata

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "PrefillSeq",
    "build_attention_metadata",
    "copy_blocks",
    "paged_attention",
    "write_kv_cache",
]
