"""Tensor parallelism on tiny random-weight models: two processes (gloo) give transformers'
greedy tokens, like one process does, with batching, chunked prefill, prefix-cache hits and
preemption by swap and by recompute; each rank's pool holds half the KV heads; nothing leaks;
a model whose heads do not divide is refused by name; a dead worker is reported."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.tiny_models import (
    Reference,
    assert_same_greedy,
    load_reference_model,
    make_tiny_model,
    reference_greedy,
    tiny_config,
)
from pagedserve.common.lifecycle import EXIT_ERROR
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.config import engine_config
from pagedserve.dataplane.kvcache import cdiv
from pagedserve.dataplane.parallel.driver import TensorParallelDriver
from pagedserve.dataplane.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
REPO = Path(__file__).resolve().parents[3]
Item = tuple[list[int], int]  # prompt, max_tokens


def workload(seed: int = 3) -> list[Item]:
    """16 prompts of 1..48 tokens; every fourth starts with one shared 24-token prefix (prefix
    hits once the first has been computed); 4 to 16 output tokens each."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(24)]
    items: list[Item] = []
    for i in range(16):
        if i % 4 == 0:
            prompt = shared + [rng.randrange(3, 384) for _ in range(rng.randint(1, 12))]
        else:
            prompt = [rng.randrange(3, 384) for _ in range(1 if i == 1 else rng.randint(2, 48))]
        items.append((prompt, rng.randint(4, 16)))
    return items


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Reference]]]:
    out = {}
    for arch in ("llama", "qwen2"):
        path = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        ref_model = load_reference_model(path)
        out[arch] = (path, [reference_greedy(ref_model, p, n) for p, n in workload()])
    return out


@pytest.fixture
def llms() -> Iterator[list[LLM]]:
    """Engines a test made; their workers end with the test (not with the test process)."""
    made: list[LLM] = []
    yield made
    for llm in made:
        if llm.engine.parallel is not None:
            llm.engine.parallel.shutdown()


def run_tp2(llms: list[LLM], path: Path, **settings: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=128, **settings)
    llms.append(llm)
    items = workload()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    outputs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    return llm, [o.token_ids for o in outputs]


def check(llm: LLM, tokens: list[list[int]], refs: list[Reference], context: str) -> None:
    exact = sum(
        assert_same_greedy(t, r, f"{context} prompt {i}")
        for i, (t, r) in enumerate(zip(tokens, refs, strict=True))
    )
    assert exact >= len(refs) - 1, f"{context}: only {exact}/{len(refs)} prompts matched exactly"
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    if engine.host_pool is not None:
        assert engine.host_pool.num_free_blocks == engine.host_pool.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_ranks_give_the_reference_greedy_tokens(
    models: dict[str, tuple[Path, list[Reference]]],
    llms: list[LLM],
    arch: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, refs = models[arch]
    # Rank 0's forwards, counted (the workers are other processes: their forwards are not).
    forwards = 0
    real_forward = ModelRunner._forward

    def counting_forward(self: ModelRunner, inputs: Any) -> Any:
        nonlocal forwards
        forwards += 1
        return real_forward(self, inputs)

    monkeypatch.setattr(ModelRunner, "_forward", counting_forward)
    llm, tokens = run_tp2(llms, path, block_size=16, max_num_seqs=16, kv_cache_memory=4 * 2**20)
    check(llm, tokens, refs, f"{arch} tp=2")
    # Each rank's pool: the same blocks (ids agree across ranks), half the KV heads. The
    # budget counts one rank's bytes, so 4 MiB holds twice the blocks of an unsplit pool.
    cfg = tiny_config(arch)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    engine = llm.engine
    assert engine.parallel is not None
    pool_shape = (engine.pool.num_blocks, 16, cfg.num_key_value_heads // 2, head_dim)
    assert tuple(engine.runner.kv_caches[0][0].shape) == pool_shape
    assert engine.parallel.worker_kv_pool_shape(1) == pool_shape
    per_rank_bytes = 2 * cfg.num_hidden_layers * 16 * (cfg.num_key_value_heads // 2) * head_dim * 4
    assert engine.pool.num_blocks == 4 * 2**20 // per_rank_bytes
    # The start-up log counts one rank's bytes too.
    planned = [
        json.loads(line) for line in capsys.readouterr().err.splitlines() if '"kv_cache_planned"' in line
    ]
    assert [(p["tensor_parallel_size"], p["blocks"]) for p in planned] == [(2, engine.pool.num_blocks)]
    assert planned[0]["bytes_per_token"] == per_rank_bytes // 16
    # Exactly one plan per forward of rank 0 reached the workers; rank 0 timed its collectives.
    assert forwards > 0
    assert engine.parallel.num_plans == forwards
    assert engine.parallel.group is not None and engine.parallel.group.comm_seconds > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_prefix_hits_and_preemption(
    models: dict[str, tuple[Path, list[Reference]]], llms: list[LLM], mode: str
) -> None:
    path, refs = models["llama"]
    items = workload()
    # The longest prompts take several 16-token prefill chunks.
    assert sum(len(p) > 16 for p, _ in items) >= 4
    demand = sum(cdiv(len(p) + n, BLOCK_SIZE) for p, n in items)
    llm, tokens = run_tp2(
        llms,
        path,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=16,  # prompts of up to 36 tokens prefill in chunks
        num_gpu_blocks_override=demand // 3,
        num_cpu_blocks_override=demand,
        preemption_mode=mode,
    )
    check(llm, tokens, refs, f"tp=2 {mode}")
    engine = llm.engine
    assert engine.kv_cache.prefix_cache_stats.hits > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_preemptions > 0
        assert engine.scheduler.num_blocks_swapped_in > 0
    else:
        assert engine.scheduler.num_recompute_preemptions > 0


def test_speculative_runs_are_verified_on_every_rank(
    models: dict[str, tuple[Path, list[Reference]]], llms: list[LLM]
) -> None:
    """Drafted runs reach the workers with the step's inputs: tokens stay the reference's."""
    from tests.dataplane.speculative.test_speculative_engine import OracleDrafter

    path, refs = models["llama"]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=128, speculative_config=spec)
    llms.append(llm)
    items = workload()
    truth = {tuple(p): r.tokens for (p, _), r in zip(items, refs, strict=True)}
    assert llm.engine.speculator is not None
    llm.engine.speculator.drafter = OracleDrafter(truth, wrong=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    outputs = llm.generate([p for p, _ in items], params, use_tqdm=False)
    check(llm, [o.token_ids for o in outputs], refs, "tp=2 speculative")
    stats = llm.engine.speculator.stats
    assert stats.accepted_tokens > 0 and stats.drafted_tokens > stats.accepted_tokens


def test_heads_that_do_not_split_are_refused_by_name(tmp_path: Path) -> None:
    path = make_tiny_model("qwen3", tmp_path)  # 6 query heads, 2 KV heads
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 must divide the model's num_attention_heads"
    ):
        LLM(str(path), tensor_parallel_size=4, max_model_len=128)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        engine_config(model=str(path), tensor_parallel_size=0)


def test_a_dead_worker_is_reported_with_its_rank(models: dict[str, tuple[Path, list[Reference]]]) -> None:
    path, _ = models["llama"]
    died: list[tuple[int, int]] = []
    reported = threading.Event()

    def on_death(rank: int, exit_code: int) -> None:
        died.append((rank, exit_code))
        reported.set()

    driver = TensorParallelDriver(
        engine_config(model=str(path), tensor_parallel_size=3), on_worker_death=on_death
    )
    try:
        assert [p.poll() for p in driver.workers] == [None, None]
        os.kill(driver.workers[1].pid, signal.SIGKILL)
        assert reported.wait(60), "the watcher did not report the dead worker"
        assert died == [(2, -signal.SIGKILL)]
    finally:
        driver.shutdown()
    assert all(p.poll() is not None for p in driver.workers)  # shutdown ended the other one


def test_a_worker_killed_mid_generation_ends_the_process_with_a_clear_error(
    models: dict[str, tuple[Path, list[Reference]]],
) -> None:
    """The default reaction, in a process of its own: a worker killed while rank 0 is stepping
    (and may be waiting in a collective with it) ends the process with the named rank, never a
    hang until the collective timeout."""
    path, _ = models["llama"]
    script = f"""
import os, signal, threading, time
from pagedserve.dataplane import LLM, SamplingParams
llm = LLM({str(path)!r}, tensor_parallel_size=2, max_model_len=1024, max_num_seqs=4)
driver = llm.engine.parallel
def kill_after_some_steps():
    while driver.num_plans < 5:
        time.sleep(0.005)
    print("killing rank 1 after", driver.num_plans, "plans", flush=True)
    os.kill(driver.workers[0].pid, signal.SIGKILL)
threading.Thread(target=kill_after_some_steps, daemon=True).start()
params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
llm.generate([[5, 6, 7, 8]] * 4, params, use_tqdm=False)
print("generate returned", flush=True)
"""
    # The timeout (far below the collectives' 300 s) is the hang check.
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "killing rank 1 after" in proc.stdout, proc.stderr[-3000:]
    assert "generate returned" not in proc.stdout
    assert proc.returncode == EXIT_ERROR, proc.stderr[-3000:]
    assert (
        f"tensor-parallel worker rank 1 died (exit code {-signal.SIGKILL}); the data plane exits"
        in proc.stderr
    )
