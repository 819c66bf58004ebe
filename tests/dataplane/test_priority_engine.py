"""Priority preemption on a real (tiny) model: with the device pool full of priority-10
streams, a priority-0 request gets its first token within its own prefill step plus at most
two decode steps (counted in steps, not timed), preempting some of them by swap or by
recompute; every preempted stream then finishes with the greedy tokens of an unpreempted run,
and both pools end all free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.dataplane import SamplingParams
from pagedserve.dataplane.config import engine_config
from pagedserve.dataplane.engine.llm_engine import LLMEngine
from pagedserve.dataplane.request import RequestStatus

BLOCK_SIZE = 4
STREAMS = 6
POOL = 36  # blocks: six 12-token prompts growing 40 tokens each overflow it


def prompt(i: int, length: int) -> list[int]:
    return [3 + (37 * i + 11 * k) % 380 for k in range(length)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def make_engine(model: Path, **settings: Any) -> LLMEngine:
    return LLMEngine(engine_config(model=str(model), max_model_len=128, block_size=BLOCK_SIZE, **settings))


def add(engine: LLMEngine, rid: str, tokens: list[int], max_tokens: int, priority: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(tokens, params, request_id=rid)
    for sample in engine.samples_of(rid):  # as the data plane's engine loop sets it
        sample.priority = priority


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.check_integrity()
    assert not engine.has_unfinished_requests()
    outputs = {}
    for rid in [f"low{i}" for i in range(STREAMS)] + ["urgent"]:
        samples = engine.samples_of(rid)
        assert [s.status for s in samples] == [RequestStatus.FINISHED_LENGTH]
        outputs[rid] = samples[0].output_token_ids
        engine.release(rid)
    return outputs


@pytest.fixture(scope="module")
def unpreempted(model: Path) -> dict[str, list[int]]:
    engine = make_engine(model, num_gpu_blocks_override=512, max_num_seqs=16)
    for i in range(STREAMS):
        add(engine, f"low{i}", prompt(i, 12), 40, 10)
    add(engine, "urgent", prompt(99, 16), 8, 0)
    outputs = finish(engine)
    assert engine.scheduler.num_preemptions == 0
    return outputs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_priority_0_preempts_priority_10_streams_and_they_finish_unchanged(
    model: Path, unpreempted: dict[str, list[int]], mode: str
) -> None:
    settings: dict[str, Any] = dict(num_gpu_blocks_override=POOL, max_num_seqs=16, preemption_mode=mode)
    if mode == "swap":
        settings["num_cpu_blocks_override"] = 4 * POOL
    engine = make_engine(model, **settings)
    for i in range(STREAMS):
        add(engine, f"low{i}", prompt(i, 12), 40, 10)
    while engine.pool.num_free_blocks > 1:  # until the streams have grown to fill the pool
        engine.step()
    assert engine.scheduler.num_running == STREAMS
    preempted_before = engine.scheduler.num_preemptions

    add(engine, "urgent", prompt(99, 16), 8, 0)
    urgent = engine.samples_of("urgent")[0]
    steps = 0
    while urgent.num_output_tokens == 0:
        engine.step()
        engine.check_integrity()
        steps += 1
        assert steps <= 3, "no first token within its prefill plus two decode steps"
    stats = engine.stats()
    assert engine.scheduler.num_priority_preemptions > 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
    else:
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    assert stats.num_preemptions > preempted_before

    outputs = finish(engine)
    assert outputs == unpreempted  # every stream, preempted or not, token for token
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.host_pool is None or engine.host_pool.num_free_blocks == engine.host_pool.num_blocks
