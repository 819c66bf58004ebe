"""KV cache writes, block copies and swaps: checked entry points, torch references.

A layer's cache is two tensors, key_cache and value_cache, each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
The cache is in the model's dtype or in FP8 (pagedserve.kernels.fp8: quantized with the layer's
k_scale / v_scale on write). Each public op validates its inputs once (pagedserve.kernels.checks) and
dispatches on `impl`, a backend name (pagedserve.kernels.backend; None: by device): the torch functions
here are the references the Triton kernels (pagedserve.kernels.triton_ops) are tested against, and the
CPU implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.backend import CacheWriteImpl, cache_impl_for, triton_interpreting
from pagedserve.kernels.checks import (
    as_bits,
    check_block_pairs,
    check_kv_caches,
    check_layer_caches,
    check_write_inputs,
)
from pagedserve.kernels.cpu_ext import load_cpu_kernels
from pagedserve.kernels.fp8 import is_fp8, quantize_fp8
from pagedserve.kernels.names import Backend


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    impl: CacheWriteImpl | None = None,
) -> None:
    """Store the step's new keys/values in their cache slots, in place.

    key, value: [T, num_kv_heads, head_dim] (head_dim contiguous); slot_mapping: [T] int64.
    Slots must be distinct and in range (build_attention_metadata guarantees it). An FP8
    cache stores fp8(x / scale), saturating, round-to-nearest-even (pagedserve.kernels.fp8).

    A bf16 cache of an fp32 model stores bf16(x), round to nearest even (torch's cast).

    impl "cpp" (fp32 and bf16 CPU caches of fp32 K/V; the engine's choice there,
    ResolvedBackends.cache_write) is the C++ copy, which checks its own inputs (RuntimeError
    naming the tensor or slot): the Python checks would cost more than the copy at decode row
    counts.
    """
    if impl == "cpp":
        if (
            key_cache.device.type != "cpu"
            or key_cache.dtype not in (torch.float32, torch.bfloat16)
            or (k_scale, v_scale) != (1.0, 1.0)
        ):
            raise ValueError(
                f"impl='cpp' writes float32 or bfloat16 CPU caches without scales, got a {key_cache.dtype} cache on "
                f"{key_cache.device} with k_scale={k_scale}, v_scale={v_scale}"
            )
        kernels = load_cpu_kernels(strict=True)
        assert kernels is not None  # strict: a failed build raised instead
        kernels.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        return
    check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if cache_impl_for(impl, key_cache.device, key_cache.dtype) == "triton":
        from pagedserve.kernels.triton_ops import write_kv_cache_triton

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
    elif key.dtype != key_cache.dtype:  # a rounded cache (pagedserve.kernels.fp8.is_rounded_cache)
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    # One row per slot: [num_blocks * block_size, KVH, D]; index_copy_ bounds-checks the slots.
    as_bits(key_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bits(key))
    as_bits(value_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bits(value))


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_to_dst: Sequence[Sequence[int]] | torch.Tensor,
    *,
    impl: Backend | None = None,
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
    check_layer_caches(caches, "layers' caches")
    num_blocks = caches[0].shape[0]
    pairs = check_block_pairs(src_to_dst, num_blocks, num_blocks)
    if pairs.numel() == 0:
        return
    if cache_impl_for(impl, caches[0].device) == "triton":
        from pagedserve.kernels.triton_ops import copy_blocks_triton

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
    impl: Backend | None = None,
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
    check_layer_caches(src_caches, "source caches")
    check_layer_caches(dst_caches, "destination caches")
    if src_caches[0].shape[1:] != dst_caches[0].shape[1:] or src_caches[0].dtype != dst_caches[0].dtype:
        raise ValueError("source and destination pools must share block shape and dtype")
    pairs = check_block_pairs(src_to_dst, src_caches[0].shape[0], dst_caches[0].shape[0])
    if pairs.numel() == 0:
        return
    src_triton = _side_uses_triton(impl, src_caches[0].device)
    dst_triton = _side_uses_triton(impl, dst_caches[0].device)
    src_ids, dst_ids = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for src, dst in zip(src_caches, dst_caches, strict=True):
        staged = _gather_blocks(src, src_ids, src_triton)
        # Pinned staging lets the host -> device direction run asynchronously (stream-ordered
        # before the device's next kernel). Device -> host stays blocking: a non-blocking copy
        # to the CPU returns before the data lands, and the host-side scatter would read it early.
        if src.device.type == "cpu" and dst.device.type == "cuda":
            staged = staged.pin_memory()
        moved = staged.to(dst.device, non_blocking=dst.device.type == "cuda")
        _scatter_blocks(dst, dst_ids, moved, dst_triton)


def _side_uses_triton(impl: Backend | None, device: torch.device) -> bool:
    """A swap's CUDA side follows impl; its host side is torch, except under the interpreter."""
    if device.type == "cuda" or impl != "triton":
        return cache_impl_for(impl, device) == "triton"
    return triton_interpreting()


def _gather_blocks(cache: torch.Tensor, ids: torch.Tensor, triton: bool) -> torch.Tensor:
    if triton:
        from pagedserve.kernels.triton_ops import gather_blocks_triton

        return gather_blocks_triton(cache, ids.to(cache.device))
    return as_bits(cache).index_select(0, ids.to(cache.device)).view(cache.dtype)


def _scatter_blocks(cache: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, triton: bool) -> None:
    if triton:
        from pagedserve.kernels.triton_ops import scatter_blocks_triton

        scatter_blocks_triton(cache, ids.to(cache.device), blocks)
    else:
        as_bits(cache).index_copy_(0, ids.to(cache.device), as_bits(blocks))
