"""Launcher of the Triton paged attention: prefill work items, decode items, split-KV."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton.language as tl

from pagedserve.kernels.checks import check_attention_inputs
from pagedserve.kernels.fp8 import is_fp8
from pagedserve.kernels.metadata import AttentionMetadata, WorkItems
from pagedserve.kernels.triton_ops import jit
from pagedserve.kernels.triton_ops.common import TL_DTYPES, check_device, next_pow2

LOG2E = 1.4426950408889634
# A decode split reads at least this many keys: shorter splits cost more in the reduction
# (and in per-program fixed work) than they gain in parallelism.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 32
# tl.dot needs at least 16 rows, columns and reduction length on GPUs.
MIN_DOT = 16


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes: block_m query rows (query tokens x padded head group) per prefill program,
    tile_n keys per inner iteration."""

    block_m: int
    tile_n: int


# GPU: 64-row prefill tiles, 64-key iterations (a bf16 K tile of head_dim 128 is 16 KiB;
# ~48 KiB of shared memory in all). fp32 queries take half of each: 64 x 64 needs ~113 KiB,
# more than sm_86/sm_89 GPUs have.
GPU_TILES = TileConfig(block_m=64, tile_n=64)
GPU_TILES_FP32 = TileConfig(block_m=32, tile_n=32)
# Interpreter: its cost is per program and per loop iteration, so tiles that cover a small
# test's context in one or two iterations (tests pick smaller ones to cross tile edges).
INTERPRETER_TILES = TileConfig(block_m=32, tile_n=32)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(num_items: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Splits per decode item (a power of two): enough programs for ~2 waves of the GPU's
    SMs, each split reading at least MIN_SPLIT_KEYS keys. 1 off CUDA."""
    if device.type != "cuda" or num_items == 0:
        return 1
    programs = num_items * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    wanted = min(math.ceil(2 * sms / programs), max_kv_len // MIN_SPLIT_KEYS, MAX_SPLITS)
    return 1 << (max(1, wanted).bit_length() - 1)


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    num_splits: int | None = None,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Triton paged attention (same contract as pagedserve.kernels.attention.paged_attention).

    Prefill chunks run as work items of several query tokens; decode tokens run as one item
    each, split along the context into num_splits parts (flash decoding) when that helps
    occupancy (choose_num_splits; num_splits overrides, a power of two). tiles overrides the
    tile sizes (tests). Returns a new contiguous [T, H, D] in the query dtype.
    """
    check_attention_inputs(query, key_cache, value_cache, meta, k_scale, v_scale)
    interpreting = check_device(query, key_cache, value_cache, meta.block_tables)
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if tiles is None:
        tiles = (
            INTERPRETER_TILES
            if interpreting
            else GPU_TILES_FP32
            if query.dtype == torch.float32
            else GPU_TILES
        )
    if tiles.tile_n < MIN_DOT or tiles.tile_n & (tiles.tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= {MIN_DOT}, got {tiles.tile_n}")
    if query.stride(2) != 1:
        query = query.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    heads_pad = next_pow2(group)
    min_block_q = max(1, MIN_DOT // heads_pad)
    launch = _Launch(
        out=out,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        qk_scale=scale * (k_scale if is_fp8(key_cache.dtype) else 1.0) * LOG2E,
        v_scale=v_scale if is_fp8(value_cache.dtype) else 1.0,
        group=group,
        heads_pad=heads_pad,
        dim_pad=max(MIN_DOT, next_pow2(head_dim)),
        tile_n=tiles.tile_n,
        interpreting=interpreting,
    )
    prefill = meta.prefill_work_items(max(min_block_q, tiles.block_m // heads_pad))
    if prefill.num_items:
        launch.run(prefill, meta.block_tables, max(min_block_q, tiles.block_m // heads_pad), 1)
    decode = meta.decode_work_items()
    if decode.num_items:
        splits = num_splits or choose_num_splits(
            decode.num_items, num_kv_heads, decode.max_kv_len, query.device
        )
        launch.run(decode, meta.decode_block_tables, min_block_q, splits)
    return out


@dataclass(frozen=True)
class _Launch:
    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    qk_scale: float
    v_scale: float
    group: int
    heads_pad: int
    dim_pad: int
    tile_n: int
    interpreting: bool

    def run(self, items: WorkItems, block_tables: torch.Tensor, block_q: int, num_splits: int) -> None:
        num_items = items.num_items
        num_heads, head_dim = self.query.shape[1], self.query.shape[2]
        num_kv_heads = self.key_cache.shape[2]
        dot_dtype = TL_DTYPES[self.query.dtype]
        if num_splits > 1:
            # Each split covers a whole number of key tiles.
            split_len = math.ceil(math.ceil(items.max_kv_len / num_splits) / self.tile_n) * self.tile_n
            device = self.query.device
            shape = (num_items, num_heads, num_splits)
            partial_out = torch.empty((*shape, self.dim_pad), dtype=torch.float32, device=device)
            partial_max = torch.empty(shape, dtype=torch.float32, device=device)
            partial_sum = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            split_len = 0
            # Unused by the single-pass variant; any tensor will do as the pointer.
            partial_out = partial_max = partial_sum = self.out
        jit.paged_attention_kernel[(num_items, num_kv_heads, num_splits)](
            self.out,
            self.query,
            self.key_cache,
            self.value_cache,
            block_tables,
            items.rows,
            items.num_queries,
            items.first_pos,
            items.table_rows,
            partial_out,
            partial_max,
            partial_sum,
            self.qk_scale,
            self.v_scale,
            self.query.stride(0),
            self.query.stride(1),
            self.out.stride(0),
            self.out.stride(1),
            self.key_cache.stride(0),
            self.key_cache.stride(1),
            self.key_cache.stride(2),
            block_tables.stride(0),
            split_len,
            self.key_cache.shape[1],
            GROUP=self.group,
            HEADS_PAD=self.heads_pad,
            BLOCK_Q=block_q,
            HEAD_DIM=head_dim,
            DIM_PAD=self.dim_pad,
            TILE_N=self.tile_n,
            NUM_SPLITS=num_splits,
            DOT_DTYPE=dot_dtype,
            IEEE_DOT=dot_dtype == tl.float32,
            INTERPRET=self.interpreting,
        )
        if num_splits > 1:
            jit.reduce_splits_kernel[(num_items, num_heads)](
                self.out,
                partial_out,
                partial_max,
                partial_sum,
                items.rows,
                self.v_scale,
                self.out.stride(0),
                self.out.stride(1),
                HEAD_DIM=head_dim,
                DIM_PAD=self.dim_pad,
                NUM_SPLITS=num_splits,
                INTERPRET=self.interpreting,
            )
