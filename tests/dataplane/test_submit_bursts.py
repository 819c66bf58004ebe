"""Heavy input is charged to its own request, not to everyone's next token (issue 30):
a burst of submits on one stream is taken into the engine a bounded number per loop
iteration, and an oversized stop_token_ids list is refused before its ids are copied.
Structural bounds, not timings; the guard stream's figures are in docs/operations.md."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from pagedserve.common.protocol import sampling_fields_from_proto
from pagedserve.common.sampling_params import MAX_STOP_TOKEN_IDS, InvalidField
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.dataplane.kvcache import KVEventRecord
from pagedserve.dataplane.server.arrivals import MAX_SUBMITS_PER_STEP
from pagedserve.dataplane.server.engine_api import Engine
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.protos.pagedserve.v1 import common_pb2
from tests.dataplane.test_engine_loop import IDENTITY, FakeEngine, Sink, settle, submit
from tests.e2e.harness import wait_until

BURST = 1_000


class CountingEngine(FakeEngine):
    """Records, once per loop iteration (the loop flushes KV events once per iteration), how
    many requests it had been given so far."""

    def __init__(self) -> None:
        super().__init__()
        self.added_by_iteration: list[int] = []

    def stats(self) -> EngineStats:
        stats = super().stats()  # (its pool of 8 blocks holds one per request: keep it >= 0)
        return dataclasses.replace(stats, total_blocks=10 * BURST, free_blocks=10 * BURST - stats.num_running)

    def take_kv_events(self) -> list[KVEventRecord]:
        self.added_by_iteration.append(len(self.added))
        return super().take_kv_events()


@pytest.fixture()
def engine() -> CountingEngine:
    return CountingEngine()


@pytest.fixture()
def loop(engine: CountingEngine) -> Iterator[EngineLoop]:
    typed: Engine = engine
    loop = EngineLoop(typed, IDENTITY)
    loop.start()
    yield loop
    loop.stop()


def test_a_burst_of_submits_is_taken_in_a_bounded_number_per_iteration(
    loop: EngineLoop, engine: CountingEngine
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    settle(loop)
    for i in range(BURST):
        submit(loop, stream, f"b{i}")
    wait_until(lambda: len(engine.added) == BURST, what="every submit taken in")
    settle(loop)
    steps = engine.added_by_iteration
    per_iteration = [b - a for a, b in itertools.pairwise(steps)]
    busy = sum(1 for n in per_iteration if n)
    print(f"\n{BURST} submits taken in over {busy} iterations, at most {max(per_iteration)} per iteration")
    assert max(per_iteration) <= MAX_SUBMITS_PER_STEP
    assert len(engine.added) == BURST and not sink.rejected()
    assert engine.added == sorted(engine.added, key=lambda rid: int(rid.split(".")[1]))  # arrival order


def test_a_submit_aborted_or_disconnected_before_it_is_taken_in_never_runs(
    loop: EngineLoop, engine: CountingEngine
) -> None:
    sink_a, sink_b = Sink(), Sink()
    a, b = loop.connect(sink_a), loop.connect(sink_b)
    settle(loop)
    for i in range(3 * MAX_SUBMITS_PER_STEP):  # more than one iteration takes in
        submit(loop, a, f"a{i}")
    submit(loop, b, "b-last")
    loop.abort(b, "b-last")
    loop.disconnect(a)
    state = settle(loop)
    assert len(engine.added) < 3 * MAX_SUBMITS_PER_STEP  # some were still waiting: dropped
    assert not any(s.request_id == "b-last" for s in state.requests)
    assert not state.requests  # what was taken in was aborted with its stream
    assert sink_b.rejected() == []


def test_a_duplicate_of_a_waiting_submit_is_refused(loop: EngineLoop, engine: CountingEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    for i in range(2 * MAX_SUBMITS_PER_STEP):
        submit(loop, stream, f"x{i}")
    submit(loop, stream, f"x{2 * MAX_SUBMITS_PER_STEP - 1}")  # still waiting, or already in
    wait_until(lambda: len(engine.added) == 2 * MAX_SUBMITS_PER_STEP, what="every submit taken in")
    settle(loop)
    assert sink.rejected() == [(f"x{2 * MAX_SUBMITS_PER_STEP - 1}", "INVALID_ARGUMENT")]
    assert len(engine.added) == 2 * MAX_SUBMITS_PER_STEP


def test_too_many_stop_token_ids_are_refused_before_they_are_copied() -> None:
    msg = common_pb2.SamplingParams(stop_token_ids=range(2_000_000))
    with pytest.raises(InvalidField, match="at most 1024 token ids, got 2000000") as refused:
        sampling_fields_from_proto(msg)
    assert refused.value.field == "stop_token_ids"
    at_bound = common_pb2.SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS))
    assert len(sampling_fields_from_proto(at_bound)["stop_token_ids"]) == MAX_STOP_TOKEN_IDS  # type: ignore[arg-type]
