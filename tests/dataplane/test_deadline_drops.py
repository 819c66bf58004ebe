"""Deadlines on the data plane without a model: the `Deadlines` table, and the engine loop
dropping a request past its `timeout_ms` wherever it is (compiling, waiting, running, swapped)
through the engine's abort path, refused DEADLINE_EXCEEDED after the tokens it streamed."""

from __future__ import annotations

from pagedserve.dataplane.request import RequestStatus
from pagedserve.dataplane.server.deadlines import Deadlines
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2
from tests.clock import FakeClock
from tests.dataplane.test_engine_loop import FakeEngine, Plan, Sink, engine, loop, run_step, settle

__all__ = ["engine", "loop"]  # the fixtures, used by name

DEADLINE = "DEADLINE_EXCEEDED"


def test_expired_soonest_first_and_forgotten() -> None:
    table: Deadlines[str] = Deadlines()
    table.add("late", 3.0)
    table.add("early", 1.0)
    table.add("mid", 2.0)
    assert table.next_deadline() == 1.0
    assert table.expired(0.5) == []
    assert table.expired(2.0) == ["early", "mid"]
    assert table.expired(2.0) == []
    assert "late" in table and len(table) == 1


def test_discard_and_replace() -> None:
    table: Deadlines[str] = Deadlines()
    table.add("a", 1.0)
    table.add("b", 1.0)
    table.discard("a")
    table.discard("never added")
    table.add("b", 5.0)  # a later deadline replaces the earlier one
    assert table.next_deadline() == 5.0
    assert table.expired(4.0) == []
    assert table.expired(5.0) == ["b"]
    assert table.next_deadline() is None


def test_requests_that_end_early_do_not_grow_the_heap() -> None:
    # Deadlines far ahead whose requests finish at once (a generous --request-timeout).
    table: Deadlines[int] = Deadlines()
    table.add(-1, 1e9)
    for i in range(10_000):
        table.add(i, 1e6 + i)
        table.discard(i)
    assert len(table) == 1
    assert len(table._heap) <= 64 + 2
    assert table.expired(1e10) == [-1]


def submit(loop: EngineLoop, stream: str, request_id: str, timeout_ms: int, regex: str | None = None) -> None:
    params = common_pb2.SamplingParams(max_tokens=4)
    if regex is not None:
        params.regex = regex
    loop.submit(
        stream,
        dataplane_pb2.SubmitCommand(
            request_id=request_id, prompt_token_ids=[1, 2, 3], sampling_params=params, timeout_ms=timeout_ms
        ),
    )


def dropped(loop: EngineLoop, state: str) -> float:
    value = loop.metrics.registry.get_sample_value(
        "pagedserve_deadline_exceeded_requests_total", {"state": state}
    )
    return value or 0.0


def test_an_idle_loop_waits_for_commands_until_the_soonest_deadline_at_most(
    loop: EngineLoop, clock: FakeClock
) -> None:
    stream = loop.connect(Sink())
    settle(loop)
    assert loop._idle_wait_s() == 0.5  # no deadline: the loop's own bound
    submit(loop, stream, "r", timeout_ms=250)
    settle(loop)
    assert loop._idle_wait_s() == 0.25  # so it wakes by itself to drop the request
    clock.advance(0.125)
    assert loop._idle_wait_s() == 0.125


def test_running_waiting_and_swapped_requests_are_dropped_at_their_deadline(
    loop: EngineLoop, engine: FakeEngine, clock: FakeClock
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "running", timeout_ms=250)
    submit(loop, stream, "waiting", timeout_ms=250)
    submit(loop, stream, "swapped", timeout_ms=250)
    submit(loop, stream, "patient", timeout_ms=0)  # no deadline
    settle(loop)
    running, _waiting, swapped, patient = (engine.samples_of(f"s1.{i}")[0] for i in range(1, 5))
    running.status, swapped.status = RequestStatus.RUNNING, RequestStatus.SWAPPED
    run_step(loop, engine, Plan({running: 7, swapped: 8, patient: 9}))

    clock.advance(0.125)
    settle(loop)
    assert sink.rejected() == []  # not yet
    clock.advance(0.125)
    settle(loop)
    assert sorted(sink.rejected()) == [("running", DEADLINE), ("swapped", DEADLINE), ("waiting", DEADLINE)]
    assert sorted(engine.aborted) == ["s1.1", "s1.2", "s1.3"]  # the engine's abort path: blocks freed
    assert sink.deltas() == [("running", 0, [7]), ("swapped", 0, [8]), ("patient", 0, [9])]
    assert sink.finished() == []
    messages = {r.request_id: r.message for m in sink.messages if m for r in m.rejected}
    assert "while it was running on the data plane, after 1 generated token(s)" in messages["running"]
    assert "while it was waiting on the data plane, after 0 generated token(s)" in messages["waiting"]
    assert [dropped(loop, s) for s in ("running", "waiting", "swapped")] == [1.0, 1.0, 1.0]
    state = settle(loop)
    assert state.snapshot.stats.num_aborted_requests == 3
    assert [r.request_id for r in state.requests] == ["patient"]

    # The one without a deadline goes on, untouched.
    run_step(loop, engine, Plan({patient: 10}, {patient: RequestStatus.FINISHED_LENGTH}))
    assert [f.request_id for f in sink.finished()] == ["patient"]


def test_a_finished_request_leaves_no_deadline_behind(
    loop: EngineLoop, engine: FakeEngine, clock: FakeClock
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r", timeout_ms=250)
    settle(loop)
    first = engine.samples_of("s1.1")[0]
    run_step(loop, engine, Plan({first: 5}, {first: RequestStatus.FINISHED_STOPPED}))
    # The same id again, now without a deadline: the old one must not end it.
    submit(loop, stream, "r", timeout_ms=0)
    settle(loop)
    clock.advance(1.0)
    state = settle(loop)
    assert sink.rejected() == []
    assert [r.request_id for r in state.requests] == ["r"]
    assert dropped(loop, "waiting") == 0.0


def test_a_request_past_its_deadline_never_steps_again(
    loop: EngineLoop, engine: FakeEngine, clock: FakeClock
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r", timeout_ms=100)
    settle(loop)
    request = engine.samples_of("s1.1")[0]
    clock.advance(0.1)
    settle(loop)
    assert sink.rejected() == [("r", DEADLINE)]
    # A step planned for it after its deadline: the loop dropped it first, nothing streams.
    run_step(loop, engine, Plan({}))
    assert sink.deltas() == []
    assert request.status is RequestStatus.FINISHED_ABORTED


def test_a_request_compiling_its_grammar_is_dropped_at_its_deadline(
    loop: EngineLoop, engine: FakeEngine, clock: FakeClock
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r", timeout_ms=100, regex="a+")
    settle(loop)
    assert sink.rejected() == []  # compiling, within its deadline
    clock.advance(0.1)
    settle(loop)
    assert sink.rejected() == [("r", DEADLINE)]
    assert dropped(loop, "compiling") == 1.0
    engine.compiler.finish(grammar=object())  # the compile ends after the deadline: ignored
    state = settle(loop)
    assert engine.added == [] and state.requests == []
