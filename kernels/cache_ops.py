"""KV cache writes and block copies (torch implementation).

A layer's cache is two tensors, key_cache and value_cache, each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's new keys/values in their cache slots, in place.

    key, value: [T, num_kv_heads, head_dim] (any strides); slot_mapping: [T] int64.
    Slots must be distinct (build_attention_metadata guarantees it).
    """
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
    for name, t in (("key", key), ("value", value)):
        # No silent casts: a dtype mismatch means the model and cache were configured apart.
        if t.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != cache dtype {key_cache.dtype}")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {key_cache.device}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {key_cache.device}")
    # One row per slot: [num_blocks * block_size, KVH, D]; index_copy_ bounds-checks the slots.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_to_dst: Sequence[Sequence[int]] | torch.Tensor,
) -> None:
    """Copy whole blocks src -> dst in every layer's caches (copy-on-write), in place.

    src_to_dst: pairs (src_block, dst_block), or an int64 tensor [N, 2]. All sources are read
    before any destination is written, so a block may be both a source and a destination.
    Destinations must be distinct.
    """
    if len(key_caches) != len(value_caches):
        raise ValueError(f"got {len(key_caches)} key caches but {len(value_caches)} value caches")
    if not key_caches:
        return
    first = key_caches[0]
    for kc, vc in zip(key_caches, value_caches, strict=True):
        check_kv_caches(kc, vc)
        if kc.shape != first.shape or kc.dtype != first.dtype or kc.device != first.device:
            raise ValueError("all layers' caches must share shape, dtype and device")
    pairs = torch.as_tensor(src_to_dst, dtype=torch.int64)
    if pairs.numel() == 0:
        return
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"src_to_dst must be (src, dst) pairs, got shape {tuple(pairs.shape)}")
    num_blocks = first.shape[0]
    if int(pairs.min()) < 0 or int(pairs.max()) >= num_blocks:
        raise ValueError(f"block ids in src_to_dst must be in [0, {num_blocks})")
    if torch.unique(pairs[:, 1]).numel() != pairs.shape[0]:
        raise ValueError("src_to_dst has duplicate destination blocks")
    pairs = pairs.to(first.device)
    src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for cache in (*key_caches, *value_caches):
        # index_select materialises the sources first, so overlapping src/dst sets are safe.
        cache.index_copy_(0, dst, cache.index_select(0, src))
