"""Fault isolation in a step (`LLMEngine._isolate_fault`), on a tiny random Llama: a request
whose own sampling or forward raises is aborted alone (blocks freed, reported in
`StepResult.faulted`) and the rest of the batch ends with the greedy tokens of a run without
it; a fault every request meets alone is raised (it ends the loop); a step of one request
is blamed once, a second in a row is raised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pagedserve.dataplane.runner.model_runner as model_runner
from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.runner import sampler

PROMPTS = [list(range(10, 30)), list(range(40, 47)), list(range(50, 83))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POISON_SEED = 4242  # a request's marker for the injected faults
POISON_TOKEN = 7  # in the poisoned prompt only


@pytest.fixture()
def llm(tiny: Path) -> Iterator[LLM]:
    yield LLM(str(tiny), max_model_len=128, block_size=16, kv_cache_memory=2**20, max_num_seqs=8)


@pytest.fixture(scope="module")
def clean(tiny: Path) -> list[list[int]]:
    llm = LLM(str(tiny), max_model_len=128, block_size=16, kv_cache_memory=2**20, max_num_seqs=8)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(llm: LLM, with_poison: list[int]) -> tuple[list[list[int]], dict[str, str], str]:
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY).request_id for p in PROMPTS]
    poisoned = engine.add_request(
        with_poison, SamplingParams(max_tokens=12, temperature=0.0, seed=POISON_SEED)
    )
    faulted: dict[str, str] = {}
    while engine.has_unfinished_requests():
        faulted.update(engine.step().faulted)
        engine.check_integrity()
    outputs = [engine.samples_of(rid)[0].output_token_ids for rid in ids]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # the poisoned one's came back
    return [list(o) for o in outputs], faulted, poisoned.request_id


def test_a_request_whose_sampling_raises_fails_alone(
    llm: LLM, clean: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sampler.sample

    def sample(logits: Any, params: list[SamplingParams], *args: Any) -> Any:
        if any(p.seed == POISON_SEED for p in params):
            raise ValueError("a sampler bug that this request alone meets")
        return real(logits, params, *args)

    monkeypatch.setattr(model_runner, "sample", sample)
    outputs, faulted, poisoned = run(llm, [1, 2, 3, 4, 5])
    assert outputs == clean
    assert list(faulted) == [poisoned] and "a sampler bug" in faulted[poisoned]


def test_a_request_whose_forward_raises_fails_alone(
    llm: LLM, clean: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = llm.engine.runner
    real = runner._forward

    def forward(inputs: Any) -> Any:
        if POISON_TOKEN in inputs.input_ids:
            raise RuntimeError("a shape this request alone has")
        return real(inputs)

    monkeypatch.setattr(runner, "_forward", forward)
    outputs, faulted, poisoned = run(llm, [1, 2, POISON_TOKEN, 4])
    assert outputs == clean
    assert list(faulted) == [poisoned]


def test_a_fault_every_request_meets_is_raised(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def forward(inputs: Any) -> Any:
        raise RuntimeError("a kernel fault")

    monkeypatch.setattr(llm.engine.runner, "_forward", forward)
    for prompt in PROMPTS:
        llm.engine.add_request(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="a kernel fault"):
        llm.engine.step()


def test_one_request_steps_are_blamed_once_then_raised(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def forward(inputs: Any) -> Any:
        raise RuntimeError("a kernel fault")

    monkeypatch.setattr(llm.engine.runner, "_forward", forward)
    first = llm.engine.add_request(PROMPTS[0], GREEDY)
    assert list(llm.engine.step().faulted) == [first.request_id]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    llm.engine.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="a kernel fault"):
        llm.engine.step()


def test_offline_generate_raises_a_request_fault(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampler.sample

    def sample(logits: Any, params: list[SamplingParams], *args: Any) -> Any:
        if any(p.seed == POISON_SEED for p in params):
            raise ValueError("a sampler bug")
        return real(logits, params, *args)

    monkeypatch.setattr(model_runner, "sample", sample)
    poisoned = SamplingParams(max_tokens=4, temperature=0.0, seed=POISON_SEED)
    with pytest.raises(RuntimeError, match="failed in a step: ValueError"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, poisoned], use_tqdm=False)
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()
