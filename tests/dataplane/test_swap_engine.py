"""Preemption by swap and by recompute on a real (tiny) model: under a workload whose KV demand
is three times the device pool, every request completes with the greedy tokens of an
unconstrained run, in every preemption mode; both kinds of preemption happen; afterwards
both pools are all free and pass their integrity checks. Plus the settings and the metrics."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from pagedserve.benchmarks.tiny_models import (
    Reference,
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
)
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.config import engine_config
from pagedserve.dataplane.engine.llm_engine import LLMEngine
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.dataplane.kvcache import PrefixCacheStats, cdiv
from pagedserve.dataplane.request import RequestStatus
from pagedserve.dataplane.server.metrics import DataPlaneMetrics

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128

Item = tuple[list[int], int, int]  # prompt, max_tokens, n


def workload(seed: int = 7) -> list[Item]:
    """24 prompts: every fourth starts with a shared 24-token prefix (prefix-cache hits), a few
    ask for two samples (which share their prompt's blocks); 8 to 32 output tokens each."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(24)]
    items: list[Item] = []
    for i in range(24):
        if i % 4 == 0:
            prompt = shared + [rng.randrange(3, 384) for _ in range(rng.randint(1, 12))]
        else:
            prompt = [rng.randrange(3, 384) for _ in range(rng.randint(2, 48))]
        items.append((prompt, rng.randint(8, 32), 2 if i % 6 == 1 else 1))
    return items


def kv_demand(items: list[Item]) -> int:
    """Blocks the workload holds when every sample has all its tokens at once."""
    return sum(n * cdiv(len(prompt) + max_tokens, BLOCK_SIZE) for prompt, max_tokens, n in items)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def refs(model: Path) -> list[Reference]:
    ref_model = load_reference_model(model)
    return [reference_greedy(ref_model, prompt, max_tokens) for prompt, max_tokens, _ in workload()]


def run(model: Path, items: list[Item], **settings: Any) -> tuple[LLMEngine, list[list[list[int]]]]:
    """Drive the engine step by step, checking its integrity (both pools) after every step."""
    engine = LLMEngine(
        engine_config(model=str(model), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, **settings)
    )
    for i, (prompt, max_tokens, n) in enumerate(items):
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"r{i}")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        steps += 1
        assert steps < 10_000
    outputs = []
    for i in range(len(items)):
        samples = engine.samples_of(f"r{i}")
        assert all(s.status is RequestStatus.FINISHED_LENGTH for s in samples)
        outputs.append([s.output_token_ids for s in samples])
        engine.release(f"r{i}")
    return engine, outputs


@pytest.fixture(scope="module")
def unconstrained(model: Path, refs: list[Reference]) -> list[list[list[int]]]:
    engine, outputs = run(model, workload(), kv_cache_memory=16 * 2**20, max_num_seqs=32)
    assert engine.scheduler.num_preemptions == 0
    exact = sum(
        assert_same_greedy(tokens, ref, f"unconstrained prompt {i}")
        for i, (samples, ref) in enumerate(zip(outputs, refs, strict=True))
        for tokens in samples
    )
    assert exact >= len(refs) - 1
    return outputs


def assert_same_as_unconstrained(
    outputs: list[list[list[int]]], base: list[list[list[int]]], refs: list[Reference], context: str
) -> None:
    """Equal to the unconstrained run, token for token; a divergence passes only where the
    transformers reference shows a numerical tie (see benchmarks/src/pagedserve/benchmarks/tiny_models.py), at most once."""
    ties = 0
    for i, (samples, base_samples, ref) in enumerate(zip(outputs, base, refs, strict=True)):
        assert len(samples) == len(base_samples)
        for tokens, expected in zip(samples, base_samples, strict=True):
            if tokens != expected:
                assert_same_greedy(tokens, ref, f"{context} prompt {i}")
                ties += 1
    assert ties <= 1, f"{context}: {ties} samples differ from the unconstrained run"


def assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    engine.pool.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    if engine.host_pool is not None:
        engine.host_pool.check_integrity()
        assert engine.host_pool.num_free_blocks == engine.host_pool.num_blocks
        assert all(b.ref_cnt == 0 for b in engine.host_pool.blocks)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_swapped == 0


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_three_times_the_pool_completes_with_unconstrained_greedy_tokens(
    model: Path, refs: list[Reference], unconstrained: list[list[list[int]]], mode: str
) -> None:
    items = workload()
    pool = kv_demand(items) // 3
    longest = max(cdiv(len(p) + m, BLOCK_SIZE) for p, m, _ in items)
    assert longest <= pool  # every request fits alone
    settings: dict[str, Any] = dict(num_gpu_blocks_override=pool, max_num_seqs=32, preemption_mode=mode)
    if mode == "swap":
        settings["num_cpu_blocks_override"] = 2 * pool  # room for every victim: never a fallback
    engine, outputs = run(model, items, **settings)
    assert kv_demand(items) >= 3 * engine.pool.num_blocks

    assert_same_as_unconstrained(outputs, unconstrained, refs, mode)
    stats = engine.stats()
    assert stats.num_preemptions == stats.num_preemptions_swap + stats.num_preemptions_recompute
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
    elif mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
        assert engine.host_pool is None and stats.host_total_blocks == 0
    else:
        # The default host pool (the device pool's bytes on the CPU); the cost model
        # swaps long victims and recomputes short ones and those whose prefix is shared.
        assert stats.host_total_blocks == pool
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    if mode != "recompute":
        assert stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0
        assert stats.swap_seconds > 0
    assert_all_free(engine)


def test_aborting_swapped_out_and_resumed_requests(model: Path, unconstrained: list[list[list[int]]]) -> None:
    """Abort a request while it is swapped out, and another right after the step that swapped
    it back in: the others finish unchanged and both pools end all free. (Aborts between
    schedule() and the copies are covered without a model, in test_swap_properties.py: the
    engine only aborts between steps.)"""
    items = workload()
    engine = LLMEngine(
        engine_config(
            model=str(model),
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=kv_demand(items) // 3,
            num_cpu_blocks_override=kv_demand(items),
            max_num_seqs=32,
            preemption_mode="swap",
        )
    )
    for i, (prompt, max_tokens, n) in enumerate(items):
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, f"r{i}")
    group_of = {s.request_id: f"r{i}" for i in range(len(items)) for s in engine.samples_of(f"r{i}")}
    aborted: list[str] = []
    swapped_before: set[str] = set()
    while engine.has_unfinished_requests():
        engine.step()
        swapped_now = {r.request_id for r in engine.scheduler.swapped}
        if not aborted and swapped_now:
            aborted.append(group_of[engine.scheduler.swapped[0].request_id])
            assert engine.abort_request(aborted[-1]) is not None  # its host blocks are freed
        elif len(aborted) == 1:
            resumed = [rid for rid in swapped_before - swapped_now if group_of[rid] not in aborted]
            if resumed:
                aborted.append(group_of[resumed[0]])
                assert engine.abort_request(aborted[-1]) is not None
        swapped_before = {r.request_id for r in engine.scheduler.swapped}
        engine.check_integrity()
    assert len(aborted) == 2
    for i in range(len(items)):
        rid = f"r{i}"
        if rid in aborted:
            assert engine.samples_of(rid) == []  # an aborted group is forgotten at once
            continue
        assert [s.output_token_ids for s in engine.samples_of(rid)] == unconstrained[i]
    assert_all_free(engine)


# -- settings --------------------------------------------------------------------------------


def test_settings_defaults_and_validation() -> None:
    config = engine_config()
    assert config.scheduler.preemption_mode == "auto"
    assert config.scheduler.watermark == 0.01
    assert config.cache.swap_space is None and config.cache.num_cpu_blocks_override is None
    for bad in ({"preemption_mode": "evict"}, {"watermark": 1.0}, {"watermark": -0.1}, {"swap_space": -1}):
        with pytest.raises(ValueError):
            engine_config(**bad)
    with pytest.raises(ValueError):
        engine_config(num_cpu_blocks_override=-1)


def test_host_pool_sizes(model: Path) -> None:
    common = dict(model=str(model), max_model_len=64, block_size=BLOCK_SIZE, num_gpu_blocks_override=40)
    assert LLMEngine(engine_config(**common)).stats().host_total_blocks == 40  # the device pool, on the CPU
    sized = LLMEngine(engine_config(**common, swap_space=0.001))
    bytes_per_block = sized.budget.shape.bytes_per_block(BLOCK_SIZE)  # 2 KiB for the tiny llama
    assert sized.stats().host_total_blocks == int(0.001 * 2**30) // bytes_per_block
    assert sized.runner.host_kv_caches[0][0].shape[0] == sized.host_pool.num_blocks  # type: ignore[union-attr]
    assert LLMEngine(engine_config(**common, preemption_mode="recompute")).host_pool is None
    with pytest.raises(ValueError, match="needs a host pool"):
        LLMEngine(engine_config(**common, preemption_mode="swap", num_cpu_blocks_override=0))


def test_llm_accepts_the_settings(model: Path) -> None:
    llm = LLM(
        str(model), max_model_len=64, num_gpu_blocks_override=16, swap_space=0.0005, preemption_mode="swap"
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 3


# -- metrics ---------------------------------------------------------------------------------


def test_swap_metrics_in_the_exposition() -> None:
    stats = EngineStats(
        total_blocks=100,
        free_blocks=40,
        cached_blocks=3,
        token_usage=0.5,
        num_running=2,
        num_waiting=1,
        num_preemptions=7,
        prefix_cache=PrefixCacheStats(),
        num_swapped=2,
        num_preemptions_swap=4,
        num_preemptions_recompute=3,
        blocks_swapped_out=30,
        blocks_swapped_in=20,
        swap_seconds=0.25,
        host_total_blocks=50,
        host_free_blocks=40,
    )
    assert stats.host_usage == pytest.approx(0.2)
    assert replace(stats, host_total_blocks=0).host_usage == 0.0
    metrics = DataPlaneMetrics(lambda: stats, {"block_size": "4"}, lambda: 0)
    text = generate_latest(metrics.registry).decode()
    for line in (
        'pagedserve_num_preemptions_by_mode_total{mode="swap"} 4.0',
        'pagedserve_num_preemptions_by_mode_total{mode="recompute"} 3.0',
        "pagedserve_num_preemptions_total 7.0",
        "pagedserve_kv_blocks_swapped_out_total 30.0",
        "pagedserve_kv_blocks_swapped_in_total 20.0",
        "pagedserve_kv_swap_seconds_total 0.25",
        "pagedserve_num_requests_swapped 2.0",
        "pagedserve_cpu_kv_cache_usage_perc 0.2",
        "pagedserve_cpu_kv_cache_total_blocks 50.0",
        "pagedserve_cpu_kv_cache_free_blocks 40.0",
    ):
        assert line in text, line
