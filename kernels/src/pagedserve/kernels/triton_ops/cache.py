"""Launchers of the cache kernels: write (with FP8 quantization), block copy, gather/scatter."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.checks import as_bits, check_write_inputs
from pagedserve.kernels.fp8 import inverse_scale, is_fp8
from pagedserve.kernels.triton_ops import jit
from pagedserve.kernels.triton_ops.common import FP8_FORMATS, check_device, next_pow2

# Elements each copy program moves (a block of SmolLM2's cache is 16 x 3 x 64 = 3072).
_COPY_CHUNK = 4096


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton write_kv_cache (same contract as pagedserve.kernels.cache_ops.write_kv_cache_torch)."""
    check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    check_device(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    fp8 = is_fp8(key_cache.dtype)
    fp8_max, mant_bits, min_exp = FP8_FORMATS.get(key_cache.dtype, (0.0, 0, 0))
    jit.write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        inverse_scale(k_scale) if fp8 else 1.0,
        inverse_scale(v_scale) if fp8 else 1.0,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_kv_heads),
        DIM_PAD=next_pow2(head_dim),
        FP8=fp8,
        FP8_MAX=fp8_max,
        MANT_BITS=mant_bits,
        MIN_EXP=min_exp,
    )


def _check_block_ids(ids: torch.Tensor, cache: torch.Tensor, what: str) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device != cache.device:
        raise ValueError(f"{what} must be a 1-D int64 tensor on {cache.device}")


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for 4-D contiguous src/dst of equal block shape."""
    block_numel = src[0].numel()
    chunk = min(_COPY_CHUNK, next_pow2(block_numel))
    grid = (src_ids.shape[0], (block_numel + chunk - 1) // chunk)
    jit.copy_blocks_kernel[grid](as_bits(src), as_bits(dst), src_ids, dst_ids, block_numel, CHUNK=chunk)


def copy_blocks_triton(caches: Sequence[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy blocks pairs[:, 0] -> pairs[:, 1] in every cache, all sources read before any write.

    caches: contiguous [num_blocks, ...] tensors sharing shape, dtype and device; pairs: [N, 2]
    int64 with distinct, in-range destinations (pagedserve.kernels.cache_ops.copy_blocks validates).
    When a block is both a source and a destination, the sources go through a staging copy.
    """
    check_device(*caches)
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        raise ValueError(f"pairs must be an int64 [N, 2] tensor, got {pairs.dtype} {tuple(pairs.shape)}")
    if pairs.shape[0] == 0:
        return
    overlap = bool(torch.isin(pairs[:, 1], pairs[:, 0]).any())
    pairs = pairs.to(caches[0].device)
    src_ids, dst_ids = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
    for cache in caches:
        if not cache.is_contiguous():
            raise ValueError("caches must be contiguous")
        if overlap:
            scatter_blocks_triton(cache, dst_ids, gather_blocks_triton(cache, src_ids))
        else:
            _launch_copy(cache, cache, src_ids, dst_ids)


def gather_blocks_triton(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """cache[ids] as a new contiguous [len(ids), ...] tensor (the swap-out staging copy)."""
    check_device(cache, ids)
    _check_block_ids(ids, cache, "ids")
    out = cache.new_empty((ids.shape[0], *cache.shape[1:]))
    if ids.shape[0]:
        _launch_copy(cache, out, ids, torch.arange(ids.shape[0], device=cache.device))
    return out


def scatter_blocks_triton(cache: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """cache[ids[i]] = blocks[i], in place (the swap-in side)."""
    check_device(cache, ids, blocks)
    _check_block_ids(ids, cache, "ids")
    if blocks.shape != (ids.shape[0], *cache.shape[1:]) or blocks.dtype != cache.dtype:
        raise ValueError(
            f"blocks must be {cache.dtype} [{ids.shape[0]}, {', '.join(map(str, cache.shape[1:]))}], "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if ids.shape[0]:
        _launch_copy(blocks.contiguous(), cache, torch.arange(ids.shape[0], device=cache.device), ids)
