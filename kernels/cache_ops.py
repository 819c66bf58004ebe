"""KV cache writes, block copies and swaps: checked entry points, torch references.

A layer's cache is two tensors, key_cache and value_cache, each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
The cache is in the model's dtype or in FP8 (kernels.fp8: quantized with the layer's
k_scale / v_scale on write). Each public op validates its inputs once and dispatches on
`impl` (kernels.backend): the torch functions here are the references the Triton kernels
(kernels.triton_ops) are tested against, and the CPU implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import KernelImpl, triton_interpreting, use_triton
from kernels.fp8 import is_fp8, quantize_fp8

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
        if not fp8 and t.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != cache dtype {key_cache.dtype}")
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {key_cache.device}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim (stride 1), got strides {t.stride()}")
    if slot_mapping.device != key_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but the cache is on {key_cache.device}")
    check_scales(key_cache.dtype, k_scale, v_scale)


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


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    impl: KernelImpl = "auto",
) -> None:
    """Store the step's new keys/values in their cache slots, in place.

    key, value: [T, num_kv_heads, head_dim] (head_dim contiguous); slot_mapping: [T] int64.
    Slots must be distinct and in range (build_attention_metadata guarantees it). An FP8
    cache stores fp8(x / scale), saturating, round-to-nearest-even (kernels.fp8).
    """
    check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if use_triton(impl, key_cache.device, key_cache.dtype):
        from kernels.triton_ops import write_kv_cache_triton

        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch reference of write_kv_cache (inputs already checked)."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    if is_fp8(key_cache.dtype):
        key = quantize_fp8(key, k_scale, key_cache.dtype)
        value = quantize_fp8(value, v_scale, value_cache.dtype)
    # One row per slot: [num_blocks * block_size, KVH, D]; index_copy_ bounds-checks the slots.
    as_bits(key_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bits(key))
    as_bits(value_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bits(value))


def _check_layer_caches(caches: Sequence[torch.Tensor], what: str) -> None:
    first = caches[0]
    for c in caches:
        if c.dim() != 4 or not c.is_contiguous():
            raise ValueError(f"{what} must be contiguous [num_blocks, block_size, KVH, D] tensors")
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError(f"all {what} must share shape, dtype and device")


def _block_pairs(
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


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_to_dst: Sequence[Sequence[int]] | torch.Tensor,
    *,
    impl: KernelImpl = "auto",
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
    for kc, vc in zip(key_caches, value_caches, strict=True):
        check_kv_caches(kc, vc)
    caches = [*key_caches, *value_caches]
    _check_layer_caches(caches, "layers' caches")
    num_blocks = caches[0].shape[0]
    pairs = _block_pairs(src_to_dst, num_blocks, num_blocks)
    if pairs.numel() == 0:
        return
    if use_triton(impl, caches[0].device):
        from kernels.triton_ops import copy_blocks_triton

        copy_blocks_triton(caches, pairs)
    else:
        copy_blocks_torch(caches, pairs)


def copy_blocks_torch(caches: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """Torch reference of copy_blocks over a flat list of caches (inputs already checked)."""
    pairs = pairs.to(caches[0].device)
    src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for cache in caches:
        bits = as_bits(cache)
        # index_select materialises the sources first, so overlapping src/dst sets are safe.
        bits.index_copy_(0, dst, bits.index_select(0, src))


def swap_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_to_dst: Sequence[Sequence[int]] | torch.Tensor,
    *,
    impl: KernelImpl = "auto",
) -> None:
    """Copy blocks between two pools on different devices (device <-> host swap), in place.

    src_caches[i] and dst_caches[i] are the same layer's cache (K or V) in the two pools:
    same block shape and dtype, any block counts and devices. Per cache the blocks are
    gathered into one contiguous staging tensor on the source device, moved in one
    transfer, and scattered on the destination device. With Triton, the gather/scatter
    on a CUDA side run as Triton kernels.
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"got {len(src_caches)} source caches but {len(dst_caches)} destination caches")
    if not src_caches:
        return
    _check_layer_caches(src_caches, "source caches")
    _check_layer_caches(dst_caches, "destination caches")
    if src_caches[0].shape[1:] != dst_caches[0].shape[1:] or src_caches[0].dtype != dst_caches[0].dtype:
        raise ValueError("source and destination pools must share block shape and dtype")
    pairs = _block_pairs(src_to_dst, src_caches[0].shape[0], dst_caches[0].shape[0])
    if pairs.numel() == 0:
        return
    src_triton = _side_uses_triton(impl, src_caches[0].device)
    dst_triton = _side_uses_triton(impl, dst_caches[0].device)
    src_ids, dst_ids = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for src, dst in zip(src_caches, dst_caches, strict=True):
        staged = _gather_blocks(src, src_ids, src_triton)
        # Pinned staging lets the host -> device direction run asynchronously.
        if src.device.type == "cpu" and dst.device.type == "cuda":
            staged = staged.pin_memory()
        _scatter_blocks(dst, dst_ids, staged.to(dst.device, non_blocking=True), dst_triton)


def _side_uses_triton(impl: KernelImpl, device: torch.device) -> bool:
    """A swap's CUDA side follows impl; its host side is torch, except under the interpreter."""
    if device.type == "cuda" or impl != "triton":
        return use_triton(impl, device)
    return triton_interpreting()


def _gather_blocks(cache: torch.Tensor, ids: torch.Tensor, triton: bool) -> torch.Tensor:
    if triton:
        from kernels.triton_ops import gather_blocks_triton

        return gather_blocks_triton(cache, ids.to(cache.device))
    return as_bits(cache).index_select(0, ids.to(cache.device)).view(cache.dtype)


def _scatter_blocks(cache: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, triton: bool) -> None:
    if triton:
        from kernels.triton_ops import scatter_blocks_triton

        scatter_blocks_triton(cache, ids.to(cache.device), blocks)
    else:
        as_bits(cache).index_copy_(0, ids.to(cache.device), as_bits(blocks))
