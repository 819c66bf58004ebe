"""The KV memory budget, with exact figures for the default model."""

from __future__ import annotations

import pytest

from pagedserve.dataplane.kvcache.budget import KVCacheShape, kv_memory_on_gpu, plan_kv_cache

SMOLLM2_FP32 = KVCacheShape(num_layers=30, num_kv_heads=3, head_dim=64, bytes_per_element=4)


def test_bytes_per_token_is_k_and_v_of_every_layer() -> None:
    assert SMOLLM2_FP32.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert SMOLLM2_FP32.bytes_per_block(16) == 737_280


def test_blocks_tokens_and_concurrency_for_two_gib() -> None:
    budget = plan_kv_cache(SMOLLM2_FP32, block_size=16, kv_memory_bytes=2 * 2**30)
    assert budget.num_blocks == 2 * 2**30 // 737_280 == 2912
    assert budget.num_tokens == 2912 * 16 == 46_592
    assert budget.max_concurrency(8192) == pytest.approx(46_592 / 8192)
    assert "2912 blocks" in budget.describe(8192)


def test_llama_7b_fp16_kv_for_a_batch_of_32_x_2048() -> None:
    # A figure often quoted about PagedAttention: LLaMA-7B, batch 32 x 2048 tokens -> "about 14 GB"
    # of KV cache (fp16). docs/capacity-planning.md checks it.
    llama7b = KVCacheShape(num_layers=32, num_kv_heads=32, head_dim=128, bytes_per_element=2)
    total = llama7b.bytes_per_token * 32 * 2048
    assert total == 32 * 2**30  # 0.5 MiB per token: 32 GiB, not 14 GB (the quote undercounts K+V)


def test_gpu_formula_and_refusals() -> None:
    assert kv_memory_on_gpu(80 * 10**9, 0.9, 26 * 10**9, 2 * 10**9) == 44 * 10**9
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_memory_on_gpu(16 * 10**9, 0.5, 13 * 10**9, 10**9)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        plan_kv_cache(SMOLLM2_FP32, block_size=16, kv_memory_bytes=1000)


def test_fp8_elements_give_2x_the_blocks_of_16_bit_and_4x_of_fp32() -> None:
    # Power-of-two shapes: 2 GiB is a multiple of every block size, so the ratios are exact.
    fp8 = plan_kv_cache(KVCacheShape(32, 4, 64, 1), 16, 2 * 2**30)
    assert fp8.num_blocks == 2 * fp8.blocks_at(2) == 4 * fp8.blocks_at(4)
    assert fp8.blocks_at(2) == plan_kv_cache(KVCacheShape(32, 4, 64, 2), 16, 2 * 2**30).num_blocks
    # SmolLM2 (30 layers, 3 kv heads): each count is floored, so FP8 may hold a few more than 4x.
    smol = plan_kv_cache(KVCacheShape(30, 3, 64, 1), 16, 2 * 2**30)
    assert 0 <= smol.num_blocks - 4 * smol.blocks_at(4) < 4
