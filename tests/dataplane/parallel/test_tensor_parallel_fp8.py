"""An FP8 KV cache split over two ranks gives the unsplit FP8 engine's greedy tokens, through
chunked prefill, prefix-cache hits and preemption by swap (the host pool holds FP8 blocks too).

Both engines use the same per-layer scales (calibrated once on rank 0, before the model is
split, and handed to the worker), and FP8 quantization is per element, so each rank stores
exactly the bytes the unsplit cache holds for its heads; only the order of the sums that
join the ranks' partial results differs. Where tokens differ, the unsplit run's top-2 logprob
margin at that position must be a numerical tie (as tests/dataplane/parallel/
test_tensor_parallel_real_model.py counts them), and at most one prompt may end in one (as
test_tensor_parallel_engine.py allows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedserve.benchmarks.tiny_models import TIE_TOLERANCE, make_tiny_model, tiny_config
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.kvcache import cdiv
from tests.dataplane.parallel.test_tensor_parallel_engine import BLOCK_SIZE, workload

KV_CACHE_DTYPE = "fp8_e4m3"


def settings() -> dict[str, Any]:
    """A pool of a third of the workload's blocks (preemption by swap) and a 16-token budget
    (prompts of up to 48 tokens prefill in chunks), as the TP engine tests' preemption case."""
    demand = sum(cdiv(len(p) + n, BLOCK_SIZE) for p, n in workload())
    return dict(
        kv_cache_dtype=KV_CACHE_DTYPE,
        block_size=BLOCK_SIZE,
        max_model_len=128,
        max_num_seqs=16,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=demand // 3,
        num_cpu_blocks_override=demand,
        preemption_mode="swap",
    )


def generate(llm: LLM) -> list[Any]:
    items = workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for _, n in items]
    return llm.generate([p for p, _ in items], params, use_tqdm=False)


def count_ties(base: list[Any], split: list[Any]) -> int:
    """How many prompts diverge; each divergence must be the unsplit run's runner-up at a tie."""
    ties = 0
    for i, (want, got) in enumerate(zip(base, split, strict=True)):
        assert len(got.token_ids) == len(want.token_ids), f"prompt {i}: lengths differ"
        if got.token_ids == want.token_ids:
            continue
        pos = next(j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b)
        (_, best), (second, runner_up) = want.outputs[0].top_logprobs[pos][:2]
        assert got.token_ids[pos] == second, f"prompt {i} token {pos}: not even the runner-up"
        margin = best - runner_up
        assert margin < TIE_TOLERANCE, f"prompt {i} token {pos}: margin {margin:.3g} is not a tie"
        ties += 1
    return ties


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.host_pool is not None
    assert engine.host_pool.num_free_blocks == engine.host_pool.num_blocks
    assert not engine.has_unfinished_requests()


def test_two_ranks_with_an_fp8_cache_give_the_unsplit_fp8_tokens(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path)
    base_llm = LLM(str(path), tensor_parallel_size=1, **settings())
    base = generate(base_llm)
    split_llm = LLM(str(path), tensor_parallel_size=2, **settings())
    try:
        split = generate(split_llm)
        ties = count_ties(base, split)
        assert ties <= 1, f"{ties} of {len(base)} prompts diverged at a tie"
        base_engine, split_engine = base_llm.engine, split_llm.engine
        # The same calibrated scales on both (the worker got rank 0's through the layout).
        assert split_engine.kv_scales is not None and split_engine.kv_scales.source.startswith("calibrated")
        assert split_engine.kv_scales == base_engine.kv_scales
        # Each rank's FP8 pool holds half of the model's 2 KV heads.
        cfg = tiny_config("llama")
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        pool_shape = (split_engine.pool.num_blocks, BLOCK_SIZE, 1, head_dim)
        key_cache = split_engine.runner.kv_caches[0][0]
        assert key_cache.dtype == torch.float8_e4m3fn and tuple(key_cache.shape) == pool_shape
        assert split_engine.parallel is not None
        assert split_engine.parallel.worker_kv_pool_shape(1) == pool_shape
        for engine in (base_engine, split_engine):
            assert engine.scheduler.num_swap_preemptions > 0
            assert engine.scheduler.num_blocks_swapped_in > 0
            assert engine.kv_cache.prefix_cache_stats.hits > 0
        for llm in (base_llm, split_llm):
            assert_nothing_held(llm)
    finally:
        if split_llm.engine.parallel is not None:
            split_llm.engine.parallel.shutdown()
