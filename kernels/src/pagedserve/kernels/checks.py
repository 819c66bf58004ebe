"""Argument checks of the kernels' public ops, shared by the torch path and the Triton launchers.

A leaf (torch and pagedserve.kernels.fp8 only): the Triton launchers re-check what their kernels assume
and would otherwise import these from the modules that dispatch to them, an import cycle.
Every check raises ValueError with what did not fit. `as_bits` is here for the same reason:
the torch references and the Triton copy launchers both move cache bits through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagedserve.kernels.fp8 import is_fp8, is_rounded_cache

if TYPE_CHECKING:
    from pagedserve.kernels.metadata import AttentionMetadata

# Same-width integer views: moving cache bits through them works for every element type
# (CPU index_copy_ has no FP8 kernels) and never canonicalises NaN payloads.
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as the integer dtype of the same width."""
    return t.view(_BITS_DTYPES[t.element_size()])


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Raise ValueError unless the pair is a valid contiguous paged cache of one layer."""
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
            f"{tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    if value_cache.device != key_cache.device:
        raise ValueError(f"value_cache is on {value_cache.device} but key_cache is on {key_cache.device}")
    # The ops address slots through flat views of the cache, which need contiguous storage.
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")


def check_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """FP8 caches need positive finite scales; other caches store values as they are (scale 1)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if is_fp8(cache_dtype):
            if not (0.0 < scale < float("inf")):
                raise ValueError(f"{name} must be positive and finite, got {scale}")
        elif scale != 1.0:
            raise ValueError(
                f"{name}={scale} given for a {cache_dtype} cache; scales apply to FP8 caches only"
            )


def check_write_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Raise ValueError unless write_kv_cache's arguments fit together."""
    check_kv_caches(key_cache, value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    fp8 = is_fp8(key_cache.dtype)
    for name, t in (("key", key), ("value", value)):
        # No silent casts: a dtype mismatch means the model and cache were configured apart.
        if fp8 and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} dtype {t.dtype} cannot be quantized into an FP8 cache")
        if not fp8 and t.dtype != key_cache.dtype and not is_rounded_cache(key_cache.dtype, t.dtype):
            raise ValueError(f"{name} dtype {t.dtype} != cache dtype {key_cache.dtype}")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {key_cache.device}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim (stride 1), got strides {t.stride()}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {key_cache.device}")
    check_scales(key_cache.dtype, k_scale, v_scale)


def check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Raise ValueError unless paged_attention's arguments fit together."""
    check_kv_caches(key_cache, value_cache)
    check_scales(key_cache.dtype, k_scale, v_scale)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_tokens, num_heads, q_head_dim = query.shape
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} tokens but the metadata describes {meta.num_tokens}")
    if q_head_dim != head_dim:
        raise ValueError(f"query head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size != meta.block_size:
        raise ValueError(f"cache block_size {block_size} != metadata block_size {meta.block_size}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype {query.dtype} is not float32, float16 or bfloat16")
    if query.dtype != key_cache.dtype and not (
        is_fp8(key_cache.dtype) or is_rounded_cache(key_cache.dtype, query.dtype)
    ):
        raise ValueError(f"query dtype {query.dtype} != cache dtype {key_cache.dtype}")
    if query.device != key_cache.device:
        raise ValueError(f"query is on {query.device} but the cache is on {key_cache.device}")
    if meta.slot_mapping.device != key_cache.device:
        raise ValueError(f"metadata is on {meta.slot_mapping.device} but the cache is on {key_cache.device}")


def check_layer_caches(caches: Sequence[torch.Tensor], what: str) -> None:
    """Raise ValueError unless the caches of several layers share one contiguous block layout."""
    first = caches[0]
    for c in caches:
        if c.dim() != 4 or not c.is_contiguous():
            raise ValueError(f"{what} must be contiguous [num_blocks, block_size, KVH, D] tensors")
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError(f"all {what} must share shape, dtype and device")


def check_block_pairs(
    src_to_dst: Sequence[Sequence[int]] | torch.Tensor, num_src: int, num_dst: int
) -> torch.Tensor:
    """Validated [N, 2] int64 (src, dst) pairs on the CPU; destinations distinct."""
    pairs = torch.as_tensor(src_to_dst, dtype=torch.int64).cpu()
    if pairs.numel() == 0:
        return pairs.view(0, 2)
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"src_to_dst must be (src, dst) pairs, got shape {tuple(pairs.shape)}")
    if int(pairs[:, 0].min()) < 0 or int(pairs[:, 0].max()) >= num_src:
        raise ValueError(f"source block ids in src_to_dst must be in [0, {num_src})")
    if int(pairs[:, 1].min()) < 0 or int(pairs[:, 1].max()) >= num_dst:
        raise ValueError(f"destination block ids in src_to_dst must be in [0, {num_dst})")
    if torch.unique(pairs[:, 1]).numel() != pairs.shape[0]:
        raise ValueError("src_to_dst has duplicate destination blocks")
    return pairs
