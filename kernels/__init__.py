"""Paged KV cache ops: metadata, cache writes/copies/swaps, paged attention, FP8 formats.

Every op has a torch implementation (the CPU default, and the reference) and a Triton one
(kernels.triton_ops, the default on CUDA; on the CPU only in Triton's interpreter), chosen
by `impl` (kernels.backend). This package is a leaf: it imports only torch, triton (lazily)
and numpy (host-side metadata), never dataplane/controlplane. See docs/kernels.md.
"""

from kernels.attention import paged_attention
from kernels.backend import KernelImpl
from kernels.cache_ops import copy_blocks, swap_blocks, write_kv_cache
from kernels.fp8 import KV_CACHE_DTYPES, KVCacheDtype, kv_cache_torch_dtype
from kernels.metadata import AttentionMetadata, DecodeGroup, PrefillSeq, build_attention_metadata

__all__ = [
    "KV_CACHE_DTYPES",
    "AttentionMetadata",
    "DecodeGroup",
    "KVCacheDtype",
    "KernelImpl",
    "PrefillSeq",
    "build_attention_metadata",
    "copy_blocks",
    "kv_cache_torch_dtype",
    "paged_attention",
    "swap_blocks",
    "write_kv_cache",
]
