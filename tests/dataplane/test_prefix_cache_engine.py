"""End to end: prompts that share system prompts still give transformers' greedy tokens when
their leading blocks come from the prefix cache (tiny random Llama, CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedserve.benchmarks.tiny_models import (
    Reference,
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
)
from pagedserve.dataplane import LLM, SamplingParams


def workload() -> list[tuple[list[int], int]]:
    """16 prompts: one of three system prompts (a block and a half to three blocks of 16),
    a random tail of 0..20 tokens, and 1..12 output tokens."""
    rng = random.Random(7)
    systems = [[rng.randrange(3, 384) for _ in range(n)] for n in (24, 32, 48)]
    items = []
    for _ in range(16):
        prompt = rng.choice(systems) + [rng.randrange(3, 384) for _ in range(rng.randint(0, 20))]
        items.append((prompt, rng.randint(1, 12)))
    return items


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Reference]]:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    ref_model = load_reference_model(path)
    return path, [reference_greedy(ref_model, p, n) for p, n in workload()]


@pytest.mark.parametrize(
    "kwargs",
    [
        # Few sequences at a time: later requests hit the blocks of earlier ones.
        {"block_size": 16, "max_num_seqs": 3},
        # Small blocks, chunked prefill and a pool small enough to evict and preempt.
        {"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 9, "num_gpu_blocks_override": 22},
    ],
)
def test_greedy_tokens_are_unchanged_by_prefix_hits(
    model: tuple[Path, list[Reference]], kwargs: dict[str, int]
) -> None:
    path, refs = model
    llm = LLM(str(path), max_model_len=128, **kwargs)
    items = workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    outputs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    exact = sum(
        assert_same_greedy(o.token_ids, r, f"prompt {i}")
        for i, (o, r) in enumerate(zip(outputs, refs, strict=True))
    )
    assert exact >= len(refs) - 1

    engine = llm.engine
    stats = engine.kv_cache.prefix_cache_stats
    assert stats.requests == len(items)
    assert stats.hits >= 8 * kwargs["block_size"]  # most requests reuse at least one block
    assert engine.pool.num_cached_blocks > 0
    if "num_gpu_blocks_override" in kwargs:
        # Preempted requests resumed from their own cached blocks.
        assert engine.scheduler.num_preemptions > 0
        assert stats.preempted_hits > 0
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
