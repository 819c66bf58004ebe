"""The engine's step loop, in its own thread, multiplexing the requests of many streams.

The engine is single-threaded by design; gRPC handlers never touch it. They post commands
(connect, submit, abort, disconnect, snapshot) to an inbox; the loop thread applies them
between steps, runs a step whenever there is work, and hands each stream one
`ConnectResponse` per step that concerns it through the stream's `sink` (a thread-safe
callable; the servicer's puts into an asyncio queue). So a slow client never stalls a step,
and a step never waits on the network.

Request ids are the control plane's, unique within its stream; the engine sees
`<stream id>/<request id>` so that two control-plane replicas can reuse ids freely.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, set_span_in_context

from dataplane.request import Request
from dataplane.server.metrics import DataPlaneMetrics
from dataplane.server.protocol import finish_reason_to_proto, kv_event_to_proto
from pagedserve.common.log import get_logger
from pagedserve.common.protocol import FINISH_REASON_NAMES, sampling_params_from_proto
from pagedserve.common.telemetry import extract, tracer
from protos.pagedserve.v1 import common_pb2, dataplane_pb2

log = get_logger(__name__)
_tracer = tracer(__name__)

Sink = Callable[[dataplane_pb2.ConnectResponse | None], None]
"""Receives a stream's responses in order; None means the loop is gone (end the stream)."""

_IDLE_WAIT_S = 0.5


class Engine(Protocol):
    """What the loop needs from LLMEngine (tests may pass a lighter engine)."""

    pool: Any
    kv_cache: Any
    scheduler: Any

    def add_request(
        self, prompt: list[int], params: Any, request_id: str | None = None, cache_salt: str | None = None
    ) -> Request: ...

    def samples_of(self, request_id: str) -> list[Request]: ...

    def release(self, request_id: str) -> None: ...

    def abort_request(self, request_id: str) -> Request | None: ...

    def step(self) -> Any: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass
class _Stream:
    stream_id: str
    sink: Sink
    requests: set[str] = field(default_factory=set)  # the control plane's ids


@dataclass
class _Group:
    """One submitted request and its samples (n > 1)."""

    stream_id: str
    request_id: str  # the control plane's id
    engine_id: str
    index_of: dict[str, int]  # sample engine id -> completion index
    unfinished: set[str]
    wants_logprobs: bool
    span: Span = INVALID_SPAN  # pagedserve.dataplane.request
    phase: Span = INVALID_SPAN  # pagedserve.prefill, then pagedserve.decode
    decoding: bool = False


@dataclass
class _Outbox:
    deltas: list[dataplane_pb2.TokenDelta] = field(default_factory=list)
    finished: list[dataplane_pb2.RequestFinished] = field(default_factory=list)
    rejected: list[dataplane_pb2.SubmitRejected] = field(default_factory=list)


@dataclass(frozen=True)
class DataPlaneIdentity:
    """What the loop reports about itself in snapshots."""

    dataplane_id: str
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    prefix_hash_seed: str
    enable_prefix_caching: bool
    kv_cache_dtype: str
    vocab_size: int

    def to_proto(self) -> dataplane_pb2.DataPlaneInfo:
        return dataplane_pb2.DataPlaneInfo(**self.__dict__)


class EngineLoop:
    def __init__(self, engine: Engine, identity: DataPlaneIdentity) -> None:
        self.engine = engine
        self.identity = identity
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._groups: dict[str, _Group] = {}  # engine id -> group
        self._outboxes: dict[str, _Outbox] = {}
        self._stream_ids = itertools.count(1)
        self._kv_event_seq = 0
        self._pending_events: list[dataplane_pb2.KVEvent] = []
        self._stats_dirty = False
        self._draining = False
        self._num_aborted = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: BaseException | None = None
        cache_info = {
            "block_size": str(identity.block_size),
            "num_gpu_blocks": str(identity.num_blocks),
            "kv_cache_dtype": identity.kv_cache_dtype,
            "enable_prefix_caching": str(identity.enable_prefix_caching).lower(),
        }
        self.metrics = DataPlaneMetrics(engine, cache_info, lambda: self._num_aborted)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._inbox.put(lambda: None)  # wake the loop
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # -- commands (any thread) -------------------------------------------------------------------
    def connect(self, sink: Sink) -> str:
        """Register a stream; its first response is a snapshot. Returns the stream id."""
        stream_id = f"s{next(self._stream_ids)}"
        self._post(lambda: self._on_connect(stream_id, sink))
        return stream_id

    def disconnect(self, stream_id: str) -> None:
        self._post(lambda: self._on_disconnect(stream_id))

    def submit(self, stream_id: str, command: dataplane_pb2.SubmitCommand) -> None:
        self._post(lambda: self._on_submit(stream_id, command))

    def abort(self, stream_id: str, request_id: str) -> None:
        self._post(lambda: self._on_abort(stream_id, request_id, notify=True))

    def set_draining(self) -> None:
        self._post(self._on_drain)

    def snapshot(self) -> Future[dataplane_pb2.GetStateResponse]:
        """A consistent GetState answer, computed between steps."""
        future: Future[dataplane_pb2.GetStateResponse] = Future()
        self._post(lambda: future.set_result(self._state()))
        return future

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                busy = self.engine.has_unfinished_requests()
                self._apply_commands(block=not busy)
                if self._stopped.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._flush()
        except BaseException as exc:  # a bug in a step: end every stream loudly, then stop
            self.fatal_error = exc
            log.exception("engine_loop_failed")
        finally:
            self._stopped.set()
            for stream in self._streams.values():
                stream.sink(None)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        started = time.perf_counter()
        result = self.engine.step()
        self.metrics.step.observe(time.perf_counter() - started)
        self.metrics.generated(len(result.new_tokens))
        self._stats_dirty = True
        for engine_id, token_id in result.new_tokens.items():
            group = self._groups.get(engine_id.split("#", 1)[0])
            if group is None:
                continue
            delta = dataplane_pb2.TokenDelta(
                request_id=group.request_id, index=group.index_of[engine_id], token_ids=[token_id]
            )
            request = self._sample(group, engine_id)
            delta.num_cached_tokens = request.num_cached_tokens
            if not group.decoding:  # the prompt is computed: prefill ends, decode begins
                group.decoding = True
                group.phase.set_attribute("pagedserve.cached_tokens", request.num_cached_tokens)
                group.phase.end()
                group.phase = _tracer.start_span("pagedserve.decode", context=set_span_in_context(group.span))
            if group.wants_logprobs:
                delta.logprobs.append(self._last_logprob(request))
            self._outbox(group.stream_id).deltas.append(delta)
        for request in result.finished:
            self._on_sample_finished(request)

    def _sample(self, group: _Group, engine_id: str) -> Request:
        return next(r for r in self.engine.samples_of(group.engine_id) if r.request_id == engine_id)

    @staticmethod
    def _last_logprob(request: Request) -> common_pb2.TokenLogprob:
        msg = common_pb2.TokenLogprob(logprob=request.output_logprobs[-1] if request.output_logprobs else 0.0)
        if request.output_top_logprobs:
            for token_id, logprob in request.output_top_logprobs[-1]:
                msg.top.append(common_pb2.TopLogprob(token_id=token_id, logprob=logprob))
        return msg

    def _on_sample_finished(self, request: Request) -> None:
        group = self._groups.get(request.request_id.split("#", 1)[0])
        if group is None or request.request_id not in group.unfinished:
            return
        group.unfinished.discard(request.request_id)
        self._outbox(group.stream_id).finished.append(self._finished_msg(group, request))
        if not group.unfinished:
            self._forget(group)
            self.engine.release(group.engine_id)

    def _finished_msg(self, group: _Group, request: Request) -> dataplane_pb2.RequestFinished:
        end = request.finish_time or time.monotonic()
        first = request.first_token_time
        reason = finish_reason_to_proto(request.status)
        self.metrics.finished(
            FINISH_REASON_NAMES[reason],
            request.num_prompt_tokens,
            request.num_output_tokens,
            (first - request.arrival_time) if first else 0.0,
            end - request.arrival_time,
        )
        return dataplane_pb2.RequestFinished(
            request_id=group.request_id,
            index=group.index_of[request.request_id],
            finish_reason=reason,
            usage=common_pb2.Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=request.num_output_tokens,
                cached_tokens=request.num_cached_tokens,
            ),
            time_to_first_token_seconds=(first - request.arrival_time) if first else 0.0,
            e2e_seconds=end - request.arrival_time,
            num_preemptions=request.num_preemptions,
        )

    def _forget(self, group: _Group, samples: list[Request] | None = None) -> None:
        samples = self.engine.samples_of(group.engine_id) if samples is None else samples
        group.phase.end()
        group.span.set_attributes(
            {
                "pagedserve.completion_tokens": sum(r.num_output_tokens for r in samples),
                "pagedserve.cached_tokens": samples[0].num_cached_tokens if samples else 0,
                "pagedserve.num_preemptions": sum(r.num_preemptions for r in samples),
                "pagedserve.finish_reason": samples[0].status.value if samples else "abort",
            }
        )
        group.span.end()
        self._groups.pop(group.engine_id, None)
        stream = self._streams.get(group.stream_id)
        if stream is not None:
            stream.requests.discard(group.request_id)

    def _outbox(self, stream_id: str) -> _Outbox:
        box = self._outboxes.get(stream_id)
        if box is None:
            box = self._outboxes[stream_id] = _Outbox()
        return box

    def _flush(self) -> None:
        """Send each stream what this iteration produced for it, plus stats and KV events."""
        records = self.engine.kv_cache.take_events()
        if records:
            self._kv_event_seq = records[-1].seq
            self._pending_events.extend(kv_event_to_proto(r) for r in records)
        if not (self._outboxes or self._pending_events or self._stats_dirty):
            return
        stats = self._stats()
        for stream in self._streams.values():
            box = self._outboxes.get(stream.stream_id, _Outbox())
            stream.sink(
                dataplane_pb2.ConnectResponse(
                    deltas=box.deltas,
                    finished=box.finished,
                    rejected=box.rejected,
                    stats=stats,
                    kv_events=self._pending_events,
                )
            )
        self._outboxes.clear()
        self._pending_events = []
        self._stats_dirty = False

    # -- command handlers (loop thread) ----------------------------------------------------------
    def _on_connect(self, stream_id: str, sink: Sink) -> None:
        self._flush()  # events before the snapshot go to the streams that were there
        self._streams[stream_id] = _Stream(stream_id, sink)
        sink(dataplane_pb2.ConnectResponse(snapshot=self._snapshot()))
        log.info("stream_connected", stream_id=stream_id, streams=len(self._streams))

    def _on_disconnect(self, stream_id: str) -> None:
        stream = self._streams.pop(stream_id, None)
        self._outboxes.pop(stream_id, None)
        if stream is None:
            return
        orphans = list(stream.requests)
        for request_id in orphans:
            self._on_abort(stream_id, request_id, notify=False)
        log.info("stream_closed", stream_id=stream_id, aborted=len(orphans), streams=len(self._streams))

    def _on_submit(self, stream_id: str, command: dataplane_pb2.SubmitCommand) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        rid = command.request_id

        def reject(code: str, message: str) -> None:
            self._outbox(stream_id).rejected.append(
                dataplane_pb2.SubmitRejected(request_id=rid, code=code, message=message)
            )

        if self._draining:
            return reject("UNAVAILABLE", "the data plane is draining")
        if not rid or rid in stream.requests:
            return reject("INVALID_ARGUMENT", f"request_id {rid!r} is empty or already in use on this stream")
        engine_id = f"{stream_id}/{rid}"
        try:
            params = sampling_params_from_proto(command.sampling_params)
            if params.best_of is not None and params.best_of != params.n:
                raise ValueError("best_of must equal n when streaming")
            primary = self.engine.add_request(
                list(command.prompt_token_ids),
                params,
                request_id=engine_id,
                cache_salt=command.cache_salt or None,
            )
        except ValueError as exc:  # bad params, or a request the scheduler can never run
            return reject("INVALID_ARGUMENT", str(exc))
        samples = self.engine.samples_of(primary.request_id)
        stream.requests.add(rid)
        span = _tracer.start_span(
            "pagedserve.dataplane.request",
            context=extract(dict(command.trace_context)),
            kind=SpanKind.SERVER,
            attributes={
                "pagedserve.request_id": rid,
                "pagedserve.dataplane_id": self.identity.dataplane_id,
                "pagedserve.prompt_tokens": len(command.prompt_token_ids),
                "pagedserve.num_samples": len(samples),
            },
        )
        self._groups[engine_id] = _Group(
            stream_id=stream_id,
            request_id=rid,
            engine_id=engine_id,
            index_of={r.request_id: i for i, r in enumerate(samples)},
            unfinished={r.request_id for r in samples},
            wants_logprobs=params.logprobs is not None,
            span=span,
            phase=_tracer.start_span("pagedserve.prefill", context=set_span_in_context(span)),
        )
        self._stats_dirty = True

    def _on_abort(self, stream_id: str, request_id: str, notify: bool) -> None:
        group = self._groups.get(f"{stream_id}/{request_id}")
        if group is None:
            return
        samples = self.engine.samples_of(group.engine_id)
        self.engine.abort_request(group.engine_id)
        self._num_aborted += 1
        finished = [self._finished_msg(group, r) for r in samples if r.request_id in group.unfinished]
        if notify:
            self._outbox(stream_id).finished.extend(finished)
        self._forget(group, samples)
        self._stats_dirty = True

    def _on_drain(self) -> None:
        self._draining = True
        self._stats_dirty = True
        log.info("draining", running=len(self._groups))

    # -- reports --------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._groups)

    def _stats(self) -> dataplane_pb2.PoolStats:
        pool, kv, sched = self.engine.pool, self.engine.kv_cache, self.engine.scheduler
        prefix = kv.prefix_cache_stats
        return dataplane_pb2.PoolStats(
            total_blocks=pool.num_blocks,
            free_blocks=pool.num_free_blocks,
            cached_blocks=pool.num_cached_blocks,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=sched.num_preemptions,
            draining=self._draining,
            num_aborted_requests=self._num_aborted,
        )

    def _snapshot(self) -> dataplane_pb2.DataPlaneSnapshot:
        return dataplane_pb2.DataPlaneSnapshot(
            info=self.identity.to_proto(),
            stats=self._stats(),
            cached_block_hashes=sorted(self.engine.pool.cached_block_hashes()),
            kv_event_seq=self._kv_event_seq,
        )

    def _state(self) -> dataplane_pb2.GetStateResponse:
        self._flush()
        response = dataplane_pb2.GetStateResponse(snapshot=self._snapshot(), num_streams=len(self._streams))
        for group in self._groups.values():
            for request in self.engine.samples_of(group.engine_id):
                response.requests.append(
                    dataplane_pb2.RunningRequest(
                        request_id=request.request_id.split("/", 1)[1],
                        stream_id=group.stream_id,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_output_tokens=request.num_output_tokens,
                        num_blocks=len(request.block_table),
                        status=request.status.value,
                    )
                )
        return response
