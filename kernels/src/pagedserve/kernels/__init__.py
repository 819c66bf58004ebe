"""Paged KV cache ops: metadata, cache writes/copies/swaps, paged attention, FP8 formats.

Every op has a torch implementation (the CPU default, and the reference) and a Triton one
(pagedserve.kernels.triton_ops, the default on CUDA; on the CPU only in Triton's interpreter), chosen
by `impl`, named in pagedserve.kernels.backend (which the engine resolves once, at start-up). This
package is a leaf: it imports only torch, triton (lazily) and numpy (host-side metadata),
never dataplane/controlplane. See docs/kernels.md.

Importing the package itself loads nothing: the names below load their module on first use,
so torch-free code (pagedserve.dataplane.config reads pagedserve.kernels.names) can import a leaf of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.kernels.attention import paged_attention
    from pagedserve.kernels.backend import AttentionImpl, ResolvedBackends, resolve_backend
    from pagedserve.kernels.cache_ops import copy_blocks, swap_blocks, write_kv_cache
    from pagedserve.kernels.fp8 import kv_cache_torch_dtype
    from pagedserve.kernels.metadata import (
        AttentionMetadata,
        DecodeGroup,
        PrefillSeq,
        build_attention_metadata,
    )
    from pagedserve.kernels.names import BACKENDS, KV_CACHE_DTYPES, Backend, KVCacheDtype

_HOMES = {
    "paged_attention": "pagedserve.kernels.attention",
    "AttentionImpl": "pagedserve.kernels.backend",
    "ResolvedBackends": "pagedserve.kernels.backend",
    "resolve_backend": "pagedserve.kernels.backend",
    "copy_blocks": "pagedserve.kernels.cache_ops",
    "swap_blocks": "pagedserve.kernels.cache_ops",
    "write_kv_cache": "pagedserve.kernels.cache_ops",
    "KV_CACHE_DTYPES": "pagedserve.kernels.names",
    "KVCacheDtype": "pagedserve.kernels.names",
    "kv_cache_torch_dtype": "pagedserve.kernels.fp8",
    "AttentionMetadata": "pagedserve.kernels.metadata",
    "DecodeGroup": "pagedserve.kernels.metadata",
    "PrefillSeq": "pagedserve.kernels.metadata",
    "build_attention_metadata": "pagedserve.kernels.metadata",
    "BACKENDS": "pagedserve.kernels.names",
    "Backend": "pagedserve.kernels.names",
}

__all__ = [
    "BACKENDS",
    "KV_CACHE_DTYPES",
    "AttentionImpl",
    "AttentionMetadata",
    "Backend",
    "DecodeGroup",
    "KVCacheDtype",
    "PrefillSeq",
    "ResolvedBackends",
    "build_attention_metadata",
    "copy_blocks",
    "kv_cache_torch_dtype",
    "paged_attention",
    "resolve_backend",
    "swap_blocks",
    "write_kv_cache",
]


if not TYPE_CHECKING:  # for mypy the imports above define these names, and a typo stays an error

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # later lookups skip this function
        return value
