"""Triton kernels behind the kernels/ API: cache write, paged attention, block copy/swap.

Importing this package imports Triton and defines the @triton.jit kernels, so it is only
imported on the first Triton call (pagedserve.kernels.backend): TRITON_INTERPRET must be set before.
Each launcher checks what its kernel assumes (shapes, dtypes, strides, devices; the checks
shared with the torch path come from the leaf pagedserve.kernels.checks, so nothing here imports the
dispatching modules back) and has a torch reference with the same signature in
pagedserve.kernels.cache_ops / pagedserve.kernels.attention.
"""

from pagedserve.kernels.triton_ops.attention import paged_attention_triton
from pagedserve.kernels.triton_ops.cache import (
    copy_blocks_triton,
    gather_blocks_triton,
    scatter_blocks_triton,
    write_kv_cache_triton,
)

__all__ = [
    "copy_blocks_triton",
    "gather_blocks_triton",
    "paged_attention_triton",
    "scatter_blocks_triton",
    "write_kv_cache_triton",
]
