"""Aborting one sample of an n > 1 request: the engine (`LLMEngine.abort_sample`, on a tiny
random Llama) and the engine loop (`EngineLoop.abort_sample`, on the scripted fake engine).

The engine frees exactly the sample's blocks (shared prefix blocks lose one reference), its
siblings' tokens are those of an unaborted run, and nothing leaks. The loop reports the
sample finished (abort) at once, so a control plane's count of finished samples reaches n,
and releases the group after its last sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.dataplane import LLM, SamplingParams
from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.server.engine_api import Engine
from pagedserve.dataplane.server.engine_loop import EngineLoop
from tests.dataplane.test_engine_loop import ABORT, IDENTITY, LENGTH, FakeEngine, Plan, Sink, run_step
from tests.dataplane.test_engine_loop import settle as settle_loop
from tests.dataplane.test_engine_loop import submit as submit_to_loop

PROMPT = list(range(10, 30))  # 20 tokens: one full block of 16 (shared by the samples) and a partial one
PARAMS = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture()
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), max_model_len=128, block_size=16, kv_cache_memory=2**20, max_num_seqs=8)


@pytest.fixture(scope="module")
def unaborted(tiny: Path) -> list[list[int]]:
    """Every sample's tokens when none is aborted."""
    llm = LLM(str(tiny), max_model_len=128, block_size=16, kv_cache_memory=2**20, max_num_seqs=8)
    return [c.token_ids for c in llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].outputs]


def run_to_end(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        llm.engine.check_integrity()


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)
    assert not engine.has_unfinished_requests()


def test_aborting_one_sample_frees_exactly_its_blocks(llm: LLM, unaborted: list[list[int]]) -> None:
    engine = llm.engine
    engine.add_request(PROMPT, PARAMS, request_id="r")
    for _ in range(20):  # the prompt, the siblings' join, then decode until private blocks fill
        engine.step()
    s0, s1, s2 = engine.samples_of("r")
    assert [s.num_output_tokens for s in (s0, s1, s2)] == [20, 19, 19]
    shared = s1.block_table[0]
    assert [s.block_table[0] for s in (s0, s1, s2)] == [shared] * 3
    private = s1.block_table[1:]
    assert len(private) == 2 and not set(private) & {b for s in (s0, s2) for b in s.block_table}
    ref_before = {b.block_id: b.ref_cnt for b in engine.pool.blocks}
    free_before = engine.pool.num_free_blocks
    tokens_at_abort = list(s1.output_token_ids)

    assert engine.abort_sample("r", 1) is s1
    assert s1.status is RequestStatus.FINISHED_ABORTED and s1.block_table == []
    assert engine.pool.num_free_blocks == free_before + len(private)  # exactly its private blocks
    ref_after = {b.block_id: b.ref_cnt for b in engine.pool.blocks}
    assert ref_after[shared] == ref_before[shared] - 1 == 2  # the shared prefix: one reference less
    assert all(ref_after[b] == 0 for b in private)
    untouched = set(ref_before) - {shared, *private}
    assert {b: ref_after[b] for b in untouched} == {b: ref_before[b] for b in untouched}
    engine.check_integrity()

    assert engine.abort_sample("r", 1) is None  # already ended: nothing more
    run_to_end(llm)
    assert [s.output_token_ids for s in engine.samples_of("r")] == [
        unaborted[0],
        tokens_at_abort,
        unaborted[2],
    ]
    assert tokens_at_abort == unaborted[1][: len(tokens_at_abort)]
    assert [s.status for s in engine.samples_of("r")] == [
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_LENGTH,
    ]
    engine.release("r")
    assert_idle(llm)


def test_aborting_the_first_sample_before_its_siblings_join_lets_them_run(
    llm: LLM, unaborted: list[list[int]]
) -> None:
    """Siblings join once the first sample has a token, or has ended: aborting it before its
    first step must admit them, not leave them waiting forever."""
    engine = llm.engine
    engine.add_request(PROMPT, PARAMS, request_id="r")
    first = engine.abort_sample("r", 0)
    assert first is not None and first.output_token_ids == []
    assert engine.scheduler.num_waiting == 2  # both siblings joined the queue at once
    run_to_end(llm)
    samples = engine.samples_of("r")
    assert [s.output_token_ids for s in samples[1:]] == unaborted[1:]
    engine.release("r")
    assert_idle(llm)


def test_aborting_a_sibling_that_never_joined(llm: LLM, unaborted: list[list[int]]) -> None:
    engine = llm.engine
    engine.add_request(PROMPT, PARAMS, request_id="r")
    third = engine.abort_sample("r", 2)
    assert third is not None and third.status is RequestStatus.FINISHED_ABORTED
    run_to_end(llm)
    samples = engine.samples_of("r")
    assert [s.output_token_ids for s in samples] == [unaborted[0], unaborted[1], []]
    assert engine.scheduler.requests == {}
    engine.release("r")
    assert_idle(llm)


def test_every_sample_aborted_one_by_one_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(PROMPT, PARAMS, request_id="r")
    engine.step()
    engine.step()
    for index in (1, 0, 2):
        assert engine.abort_sample("r", index) is not None
        engine.check_integrity()
    assert not engine.has_unfinished_requests()
    engine.release("r")
    assert_idle(llm)


def test_abort_sample_of_what_is_not_there(llm: LLM) -> None:
    engine = llm.engine
    assert engine.abort_sample("nope", 0) is None
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=2, ignore_eos=True), request_id="r")
    assert engine.abort_sample("r", 2) is None and engine.abort_sample("r", -1) is None
    run_to_end(llm)
    assert engine.abort_sample("r", 0) is None  # finished: nothing to abort
    engine.release("r")
    assert engine.abort_sample("r", 0) is None  # released: unknown
    assert_idle(llm)


# -- the engine loop -------------------------------------------------------------------------


class SampleAbortingEngine(FakeEngine):
    """The fake engine plus the per-sample abort the loop calls."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted_samples: list[tuple[str, int]] = []

    def abort_sample(self, request_id: str, index: int) -> Request | None:
        samples = self.groups.get(request_id)
        if samples is None or not 0 <= index < len(samples) or samples[index].status.finished:
            return None
        self.aborted_samples.append((request_id, index))
        samples[index].status = RequestStatus.FINISHED_ABORTED
        samples[index].finish_time = self.clock
        return samples[index]


@pytest.fixture()
def fake() -> SampleAbortingEngine:
    return SampleAbortingEngine()


@pytest.fixture()
def loop(fake: SampleAbortingEngine) -> Iterator[EngineLoop]:
    typed: Engine = fake
    loop = EngineLoop(typed, IDENTITY)
    loop.start()
    yield loop
    loop.stop()
    assert loop.fatal_error is None


def test_loop_aborts_one_sample_and_the_others_run_on(loop: EngineLoop, fake: SampleAbortingEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit_to_loop(loop, stream, "r", n=3)
    settle_loop(loop)
    s0, s1, s2 = fake.samples_of("s1.1")
    run_step(loop, fake, Plan({s0: 7, s1: 8, s2: 9}))  # t=101
    loop.abort_sample(stream, "r", 1)
    settle_loop(loop)
    assert fake.aborted_samples == [("s1.1", 1)]
    assert [(f.index, f.finish_reason, f.usage.completion_tokens) for f in sink.finished()] == [(1, ABORT, 1)]
    assert fake.aborted == [] and fake.released == []  # the request itself runs on
    loop.abort_sample(stream, "r", 1)  # twice, or for a sample that is not there: nothing
    loop.abort_sample(stream, "r", 5)
    loop.abort_sample(stream, "other", 0)
    run_step(loop, fake, Plan({s0: 10, s2: 11}, {s0: RequestStatus.FINISHED_LENGTH}))  # t=102
    assert fake.aborted_samples == [("s1.1", 1)]
    assert sink.deltas() == [("r", 0, [7]), ("r", 1, [8]), ("r", 2, [9]), ("r", 0, [10]), ("r", 2, [11])]
    assert [(f.index, f.finish_reason) for f in sink.finished()] == [(1, ABORT), (0, LENGTH)]
    assert loop.num_requests == 1
    # The last sample's abort ends the group: released once, never aborted as a whole.
    loop.abort_sample(stream, "r", 2)
    state = settle_loop(loop)
    assert [(f.index, f.finish_reason) for f in sink.finished()] == [(1, ABORT), (0, LENGTH), (2, ABORT)]
    assert fake.released == ["s1.1"] and fake.aborted == []
    assert loop.num_requests == 0 and list(state.requests) == []
    assert state.snapshot.stats.num_aborted_requests == 0  # samples, not requests, were aborted
    abort = loop.metrics.registry.get_sample_value(
        "pagedserve_request_success_total", {"finished_reason": "abort"}
    )
    assert abort == 2.0
