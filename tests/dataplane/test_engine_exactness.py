"""Greedy outputs equal transformers' own generate on tiny random models of every architecture,
whatever the batch composition, block size, chunking or preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.tiny_models import (
    Reference,
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
)
from pagedserve.benchmarks.tiny_models import (
    exactness_workload as workload,
)
from pagedserve.dataplane import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Reference]]]:
    """Each architecture's model folder and the reference tokens for the workload."""
    out = {}
    for arch in ARCHS:
        path = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        ref_model = load_reference_model(path)
        refs = [reference_greedy(ref_model, prompt, n) for prompt, n in workload()]
        out[arch] = (path, refs)
    return out


def run_engine(path: Path, **kwargs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), max_model_len=256, **kwargs)
    items = workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    outputs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    return llm, [o.token_ids for o in outputs]


def check_all(tokens: list[list[int]], refs: list[Reference], context: str) -> None:
    exact = sum(
        assert_same_greedy(t, r, f"{context} prompt {i}")
        for i, (t, r) in enumerate(zip(tokens, refs, strict=True))
    )
    # Ties are rare; if most prompts diverged something is wrong even if each divergence looked like a tie.
    assert exact >= len(refs) - 2, f"{context}: only {exact}/{len(refs)} prompts matched exactly"


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_transformers(models: dict[str, Any], arch: str) -> None:
    path, refs = models[arch]
    llm, tokens = run_engine(path, block_size=16, max_num_seqs=32, kv_cache_memory=16 * 2**20)
    check_all(tokens, refs, arch)
    assert_no_leaks(llm)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(models: dict[str, Any], block_size: int) -> None:
    path, refs = models["llama"]
    llm, tokens = run_engine(path, block_size=block_size, max_num_seqs=32, kv_cache_memory=16 * 2**20)
    check_all(tokens, refs, f"block_size={block_size}")
    assert_no_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_with_tiny_token_budget(models: dict[str, Any], arch: str) -> None:
    path, refs = models[arch]
    llm, tokens = run_engine(path, block_size=4, max_num_seqs=8, max_num_batched_tokens=7)
    check_all(tokens, refs, f"{arch} chunked")
    assert_no_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_under_a_small_pool(models: dict[str, Any], arch: str) -> None:
    path, refs = models[arch]
    # 24 blocks of 4 tokens: the longest request (70 + 20 tokens) fits alone, 32 at once do not.
    llm, tokens = run_engine(path, block_size=4, max_num_seqs=32, num_gpu_blocks_override=24)
    assert llm.engine.scheduler.num_preemptions > 0
    check_all(tokens, refs, f"{arch} preempted")
    assert_no_leaks(llm)
