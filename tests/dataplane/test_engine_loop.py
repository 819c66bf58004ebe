"""The engine loop without a model: a scripted fake engine behind the `Engine` protocol.

The loop runs in its own thread, as in production. A test queues what the next engine step
produces, then waits for two snapshots: the loop applies commands before it steps, so the
second snapshot is answered only after the step and its flush.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.engine.outputs import EngineStats, StepResult, sample_request_id
from pagedserve.dataplane.kvcache import BlockHash, BlockStored, KVEventRecord, PrefixCacheStats
from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.server.engine_api import DataPlaneIdentity, Engine
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.groups import GroupTable, SampleId, StreamRequestKey
from pagedserve.protos.pagedserve.v1 import common_pb2, dataplane_pb2
from tests.clock import FakeClock

ARRIVAL = 100.0  # every fake request arrives then; each step advances the clock by 1 s
STOP, LENGTH, ABORT = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
)


@dataclass
class Plan:
    """One step: a token for each request in `tokens`, then `finish` ends requests."""

    tokens: dict[Request, int] = field(default_factory=dict)
    finish: dict[Request, RequestStatus] = field(default_factory=dict)


class FakeCompiler:
    """Holds each submitted constraint until the test answers it (`finish`), like a compile
    that takes as long as the test wants."""

    def __init__(self) -> None:
        self.submitted: queue.SimpleQueue[tuple[Any, Callable[[Any, Any], None]]] = queue.SimpleQueue()

    def submit(self, constraint: Any, done: Callable[[Any, Any], None]) -> None:
        self.submitted.put((constraint, done))

    def finish(self, grammar: Any = None, error: Exception | None = None) -> Any:
        constraint, done = self.submitted.get(timeout=5)
        done(grammar, error)
        return constraint


class FakeEngine:
    """The engine's contract on scripted steps: samples, release, abort; no model, no blocks."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Request]] = {}
        self.added: list[str] = []  # request ids in the order the loop added them
        self.released: list[str] = []
        self.aborted: list[str] = []
        self.events: queue.SimpleQueue[KVEventRecord] = queue.SimpleQueue()  # the test thread puts
        self.plans: queue.SimpleQueue[Plan] = queue.SimpleQueue()
        self.clock = ARRIVAL
        self.compiler = FakeCompiler()
        self.grammar_of: dict[str, Any] = {}  # request id -> the grammar it was added with

    def grammars(self) -> FakeCompiler:
        return self.compiler

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        grammar: Any = None,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
        pooling: Any = None,
    ) -> Request:
        assert request_id is not None and request_id not in self.groups and pooling is None
        assert (grammar is None) == (params.constraint is None)
        self.grammar_of[request_id] = grammar
        if len(prompt) > 8:
            raise ValueError("prompt too long for the fake")
        self.groups[request_id] = [
            Request(
                sample_request_id(request_id, i),
                prompt,
                params,
                arrival_time=ARRIVAL,
                priority=priority,
                tenant=tenant,
                tenant_weight=tenant_weight,
            )
            for i in range(params.num_samples)
        ]
        self.added.append(request_id)
        return self.groups[request_id][0]

    def samples_of(self, request_id: str) -> list[Request]:
        return list(self.groups.get(request_id, []))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.groups.pop(request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        samples = self.groups.pop(request_id, None)
        if samples is None:
            return None
        self.aborted.append(request_id)
        for r in samples:
            if not r.status.finished:
                r.status = RequestStatus.FINISHED_ABORTED
                r.finish_time = self.clock  # the real engine leaves it unset; the fake keeps e2e exact
        return samples[0]

    def step(self) -> StepResult:
        plan = self.plans.get_nowait()
        self.clock += 1.0
        for request, token in plan.tokens.items():
            if request.first_token_time is None:
                request.first_token_time = self.clock
            request.append_output_token(token)
        for request, status in plan.finish.items():
            request.status = status
            request.finish_time = self.clock
        new_tokens = {r.request_id: [t] for r, t in plan.tokens.items()}
        return StepResult(new_tokens, list(plan.finish), len(plan.tokens), 0)

    def has_unfinished_requests(self) -> bool:
        return not self.plans.empty()

    def abort_sample(self, request_id: str, index: int) -> Request | None:
        raise AssertionError("no per-sample abort here (test_sample_abort.py's engine has one)")

    def stats(self) -> EngineStats:
        running = sum(not r.status.finished for g in self.groups.values() for r in g)
        return EngineStats(
            total_blocks=8,
            free_blocks=8 - running,
            cached_blocks=0,
            token_usage=0.0,
            num_running=running,
            num_waiting=0,
            num_preemptions=0,
            prefix_cache=PrefixCacheStats(requests=2, queries=64, hits=16),
        )

    def take_kv_events(self) -> list[KVEventRecord]:
        events = []
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events

    def cached_block_hashes(self) -> set[BlockHash]:
        return set()


class Sink:
    """A stream's receiving end: every response the loop handed it, in order."""

    def __init__(self) -> None:
        self.messages: list[dataplane_pb2.ConnectResponse | None] = []

    def __call__(self, message: dataplane_pb2.ConnectResponse | None) -> None:
        self.messages.append(message)

    def deltas(self) -> list[tuple[str, int, list[int]]]:
        return [(d.request_id, d.index, list(d.token_ids)) for m in self.messages if m for d in m.deltas]

    def finished(self) -> list[dataplane_pb2.RequestFinished]:
        return [f for m in self.messages if m for f in m.finished]

    def rejected(self) -> list[tuple[str, str]]:
        return [(r.request_id, r.code) for m in self.messages if m for r in m.rejected]


IDENTITY = DataPlaneIdentity(
    dataplane_id="dp-test",
    model="fake",
    block_size=16,
    num_blocks=8,
    max_model_len=128,
    max_num_seqs=4,
    prefix_hash_seed="seed",
    enable_prefix_caching=True,
    kv_cache_dtype="auto",
    vocab_size=100,
)


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def loop(engine: FakeEngine, clock: FakeClock) -> Iterator[EngineLoop]:
    typed: Engine = engine
    loop = EngineLoop(typed, IDENTITY, clock)
    loop.start()
    yield loop
    loop.stop()
    assert loop.fatal_error is None


def settle(loop: EngineLoop) -> dataplane_pb2.GetStateResponse:
    """Wait until every command posted so far, and the step they allowed, is applied and sent."""
    loop.snapshot().result(timeout=5)
    return loop.snapshot().result(timeout=5)


def run_step(loop: EngineLoop, engine: FakeEngine, plan: Plan) -> None:
    engine.plans.put(plan)
    settle(loop)


def submit(
    loop: EngineLoop, stream_id: str, request_id: str, n: int = 1, prompt: int = 3, regex: str | None = None
) -> None:
    params = common_pb2.SamplingParams(n=n, max_tokens=4)
    if regex is not None:
        params.regex = regex
    command = dataplane_pb2.SubmitCommand(
        request_id=request_id, prompt_token_ids=list(range(1, prompt + 1)), sampling_params=params
    )
    loop.submit(stream_id, command)


def ends(sink: Sink) -> list[tuple[str, int, int, int, float, float]]:
    """(request id, index, finish reason, completion tokens, ttft, e2e) of each finished sample."""
    return [
        (
            f.request_id,
            f.index,
            f.finish_reason,
            f.usage.completion_tokens,
            f.time_to_first_token_seconds,
            f.e2e_seconds,
        )
        for f in sink.finished()
    ]


def test_first_response_is_a_snapshot(loop: EngineLoop) -> None:
    sink = Sink()
    assert loop.connect(sink) == "s1"
    settle(loop)
    first = sink.messages[0]
    assert first is not None and first.HasField("snapshot")
    assert first.snapshot.info.dataplane_id == "dp-test"
    assert first.snapshot.stats.total_blocks == 8 and first.snapshot.stats.free_blocks == 8


def test_n3_samples_finishing_out_of_order(loop: EngineLoop, engine: FakeEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r", n=3)
    settle(loop)
    assert engine.added == ["s1.1"]
    s0, s1, s2 = engine.samples_of("s1.1")
    run_step(loop, engine, Plan({s0: 7, s1: 8, s2: 9}))  # t=101: every sample's first token
    run_step(loop, engine, Plan({s2: 10}, {s2: RequestStatus.FINISHED_STOPPED}))  # t=102
    run_step(loop, engine, Plan({s0: 11}, {s0: RequestStatus.FINISHED_LENGTH}))  # t=103
    assert engine.released == []  # sample 1 still runs
    assert loop.num_requests == 1
    run_step(loop, engine, Plan({}, {s1: RequestStatus.FINISHED_STOPPED}))  # t=104

    assert sink.deltas() == [("r", 0, [7]), ("r", 1, [8]), ("r", 2, [9]), ("r", 2, [10]), ("r", 0, [11])]
    assert ends(sink) == [
        ("r", 2, STOP, 2, 1.0, 2.0),
        ("r", 0, LENGTH, 2, 1.0, 3.0),
        ("r", 1, STOP, 1, 1.0, 4.0),
    ]
    assert [f.usage.prompt_tokens for f in sink.finished()] == [3, 3, 3]
    assert engine.released == ["s1.1"]  # once, after the last sample
    assert engine.aborted == []
    assert loop.num_requests == 0
    stop = loop.metrics.registry.get_sample_value(
        "pagedserve_request_success_total", {"finished_reason": "stop"}
    )
    assert stop == 2.0


def test_a_sample_reported_finished_twice_ends_once(loop: EngineLoop, engine: FakeEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r", n=2)
    settle(loop)
    s0, s1 = engine.samples_of("s1.1")
    run_step(loop, engine, Plan({s0: 5}, {s0: RequestStatus.FINISHED_STOPPED}))
    run_step(loop, engine, Plan({}, {s0: RequestStatus.FINISHED_STOPPED}))
    assert [(f.index, f.finish_reason) for f in sink.finished()] == [(0, STOP)]
    assert engine.released == []
    run_step(loop, engine, Plan({s1: 6}, {s1: RequestStatus.FINISHED_LENGTH}))
    assert [(f.index, f.finish_reason) for f in sink.finished()] == [(0, STOP), (1, LENGTH)]
    assert engine.released == ["s1.1"]


def test_disconnect_aborts_that_streams_requests_only(loop: EngineLoop, engine: FakeEngine) -> None:
    sink_a, sink_b = Sink(), Sink()
    a, b = loop.connect(sink_a), loop.connect(sink_b)
    submit(loop, a, "x", n=2)
    submit(loop, a, "y")
    submit(loop, b, "z")
    settle(loop)
    assert engine.added == ["s1.1", "s1.2", "s2.3"]
    loop.disconnect(a)
    state = settle(loop)

    assert sorted(engine.aborted) == ["s1.1", "s1.2"]
    assert [(r.request_id, r.stream_id, r.status) for r in state.requests] == [("z", "s2", "waiting")]
    assert state.num_streams == 1
    assert state.snapshot.stats.num_aborted_requests == 2
    assert sink_a.finished() == []  # the stream is gone: its ends are not sent
    assert loop.num_requests == 1
    aborts = loop.metrics.registry.get_sample_value(
        "pagedserve_request_success_total", {"finished_reason": "abort"}
    )
    assert aborts == 3.0  # x's two samples and y: counted though never sent

    (z,) = engine.samples_of("s2.3")
    run_step(loop, engine, Plan({z: 4}, {z: RequestStatus.FINISHED_LENGTH}))
    assert sink_b.deltas() == [("z", 0, [4])]
    assert [(f.request_id, f.finish_reason) for f in sink_b.finished()] == [("z", LENGTH)]


def test_two_streams_may_use_the_same_request_id(loop: EngineLoop, engine: FakeEngine) -> None:
    sink_a, sink_b = Sink(), Sink()
    a, b = loop.connect(sink_a), loop.connect(sink_b)
    submit(loop, a, "r")
    submit(loop, b, "r", n=2)
    settle(loop)
    assert engine.added == ["s1.1", "s2.2"]
    (ra,) = engine.samples_of("s1.1")
    rb0, rb1 = engine.samples_of("s2.2")
    run_step(loop, engine, Plan({ra: 1, rb0: 2, rb1: 3}))
    assert sink_a.deltas() == [("r", 0, [1])]
    assert sink_b.deltas() == [("r", 0, [2]), ("r", 1, [3])]

    loop.abort(a, "r")
    state = settle(loop)
    assert engine.aborted == ["s1.1"]
    assert ends(sink_a) == [("r", 0, ABORT, 1, 1.0, 1.0)]
    assert sink_b.finished() == []
    assert [(r.request_id, r.stream_id, r.num_output_tokens) for r in state.requests] == [
        ("r", "s2", 1),
        ("r", "s2", 1),
    ]


def test_a_client_id_that_looks_like_a_sample_id_does_not_collide(
    loop: EngineLoop, engine: FakeEngine
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "a", n=2)  # its second sample's engine id would be "<a's id>#1"
    submit(loop, stream, "a#1")
    settle(loop)
    assert sink.rejected() == []
    a0, a1 = engine.samples_of(engine.added[0])
    (other,) = engine.samples_of(engine.added[1])
    assert len({a0.request_id, a1.request_id, other.request_id}) == 3
    run_step(loop, engine, Plan({a1: 5, other: 6}, {other: RequestStatus.FINISHED_STOPPED}))
    assert sink.deltas() == [("a", 1, [5]), ("a#1", 0, [6])]
    assert [(f.request_id, f.index) for f in sink.finished()] == [("a#1", 0)]
    assert engine.released == [engine.added[1]]


def test_rejections(loop: EngineLoop, engine: FakeEngine) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "r")
    submit(loop, stream, "r")  # in use on this stream
    submit(loop, stream, "")
    submit(loop, stream, "long", prompt=9)  # the engine's ValueError
    loop.set_draining()
    submit(loop, stream, "late")
    state = settle(loop)
    # (a duplicate or a submit after the drain is refused as it arrives, the rest as it is
    # taken in, a bounded number per step: the order across request ids is not kept)
    assert sorted(sink.rejected()) == [
        ("", "INVALID_ARGUMENT"),
        ("late", "UNAVAILABLE"),
        ("long", "INVALID_ARGUMENT"),
        ("r", "INVALID_ARGUMENT"),
    ]
    assert engine.added == ["s1.1"]
    assert state.snapshot.stats.draining


def test_kv_events_and_stats_go_to_every_stream(loop: EngineLoop, engine: FakeEngine) -> None:
    sink_a, sink_b = Sink(), Sink()
    loop.connect(sink_a)
    loop.connect(sink_b)
    settle(loop)
    stored = BlockStored(
        block_hashes=(BlockHash(b"h1"),), parent_block_hash=None, token_ids=(1, 2), block_size=2
    )
    engine.events.put(KVEventRecord(seq=7, event=stored))
    state = settle(loop)
    for sink in (sink_a, sink_b):
        events = [e for m in sink.messages if m for e in m.kv_events]
        assert [(e.seq, list(e.stored.block_hashes)) for e in events] == [(7, [b"h1"])]
    assert state.snapshot.kv_event_seq == 7


def test_metrics_read_the_engine_stats_at_scrape_time(loop: EngineLoop, engine: FakeEngine) -> None:
    stream = loop.connect(Sink())
    submit(loop, stream, "x", n=2)
    submit(loop, stream, "y")
    loop.abort(stream, "y")
    settle(loop)
    registry = loop.metrics.registry
    assert registry.get_sample_value("pagedserve_kv_cache_free_blocks") == 6.0
    assert registry.get_sample_value("pagedserve_kv_cache_usage_perc") == 0.25
    assert registry.get_sample_value("pagedserve_num_requests_running") == 2.0
    assert registry.get_sample_value("pagedserve_prefix_cache_hit_rate") == 0.25
    assert registry.get_sample_value("pagedserve_prefix_cache_queries_total") == 64.0
    assert registry.get_sample_value("pagedserve_num_aborted_requests_total") == 1.0


def test_group_table_maps_engine_ids_to_typed_samples() -> None:
    table = GroupTable()
    key = StreamRequestKey("s1", "r")
    assert key == StreamRequestKey("s1", "r") and key != StreamRequestKey("s2", "r")
    assert table.engine_request_id(key) == "s1.1"
    assert table.engine_request_id(StreamRequestKey("s2", "r")) == "s2.2"
    assert SampleId(key, 1) == SampleId(StreamRequestKey("s1", "r"), 1)


def test_a_constrained_request_waits_for_its_grammar_while_others_step(
    loop: EngineLoop, engine: FakeEngine
) -> None:
    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "json", regex="[0-9]+")
    submit(loop, stream, "plain")
    settle(loop)
    assert engine.added == ["s1.1"]  # "plain": the constrained one is compiling, not in the engine
    plain = engine.groups["s1.1"][0]
    run_step(loop, engine, Plan(tokens={plain: 7}))
    run_step(loop, engine, Plan(tokens={plain: 8}))
    assert sink.deltas() == [("plain", 0, [7]), ("plain", 0, [8])]
    grammar = object()
    assert engine.compiler.finish(grammar).value == "[0-9]+"
    settle(loop)
    assert engine.added == ["s1.1", "s1.2"]
    assert engine.grammar_of["s1.2"] is grammar
    counted = loop.metrics.registry.get_sample_value(
        "pagedserve_structured_output_requests_total", {"kind": "regex"}
    )
    assert counted == 1.0


def test_a_grammar_refusal_rejects_the_request_by_name(loop: EngineLoop, engine: FakeEngine) -> None:
    from pagedserve.dataplane.structured.grammar import GrammarError

    sink = Sink()
    stream = loop.connect(sink)
    submit(loop, stream, "bad", regex="(")
    submit(loop, stream, "bad", regex="(")  # its id is in use while it compiles
    engine.compiler.finish(error=GrammarError("regex", "could not be compiled: unbalanced parenthesis"))
    settle(loop)
    rejected = [r for m in sink.messages if m for r in m.rejected]
    assert [(r.request_id, r.code) for r in rejected] == [
        ("bad", "INVALID_ARGUMENT"),
        ("bad", "INVALID_ARGUMENT"),
    ]
    assert "already in use" in rejected[0].message
    assert rejected[1].message == "regex could not be compiled: unbalanced parenthesis"
    assert engine.added == []
    assert loop.metrics.registry.get_sample_value("pagedserve_structured_output_refusals_total") == 1.0


def test_abort_or_disconnect_while_compiling_never_admits(loop: EngineLoop, engine: FakeEngine) -> None:
    sink_a, sink_b = Sink(), Sink()
    stream_a, stream_b = loop.connect(sink_a), loop.connect(sink_b)
    submit(loop, stream_a, "r", regex="a")
    submit(loop, stream_b, "r", regex="b")
    settle(loop)
    loop.abort(stream_a, "r")
    loop.disconnect(stream_b)
    settle(loop)
    finished = threading.Event()
    for _ in range(2):
        engine.compiler.finish(object())
    loop.snapshot().add_done_callback(lambda _: finished.set())
    assert finished.wait(5)
    settle(loop)
    assert engine.added == []
    assert sink_a.rejected() == [] and sink_a.finished() == []
