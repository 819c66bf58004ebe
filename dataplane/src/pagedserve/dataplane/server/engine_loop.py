"""The engine's step loop, in its own thread, multiplexing the requests of many streams.

The engine is single-threaded by design; gRPC handlers never touch it. They post commands
(connect, submit, abort a request or one of its samples, disconnect, snapshot) to an inbox;
the loop thread applies them between steps, runs a step whenever there is work, and hands
each stream one `ConnectResponse` per step that concerns it through the stream's `sink` (a
thread-safe callable; the servicer's puts into an asyncio queue). So a slow client never
stalls a step, and a step never waits on the network.

What the loop drives and reports: engine_api.py. Streams and their outboxes: streams.py.
Requests, their samples and their typed ids: groups.py. Deadlines (a submit's `timeout_ms`):
deadlines.py; before every step the requests past theirs are dropped through the abort path
and refused DEADLINE_EXCEEDED, after whatever tokens they had streamed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from pagedserve.common.clock import SYSTEM_CLOCK, Clock
from pagedserve.common.log import get_logger
from pagedserve.common.priority import priority_refusal
from pagedserve.common.protocol import sampling_params_from_proto
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.tenant_share import tenant_refusal, wire_weight
from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.server.arrivals import Arrival, Arrivals
from pagedserve.dataplane.server.deadlines import Deadlines
from pagedserve.dataplane.server.engine_api import DataPlaneIdentity, Engine
from pagedserve.dataplane.server.groups import Group, GroupTable, SampleId, StreamRequestKey, request_finished
from pagedserve.dataplane.server.metrics import (
    DataPlaneMetrics,
    fair_share_preemptions,
    kernel_info,
    priority_preemptions,
)
from pagedserve.dataplane.server.protocol import kv_event_to_proto, pool_stats_to_proto, pooling_of
from pagedserve.dataplane.server.streams import Sink, StreamMux
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

log = get_logger(__name__)

_IDLE_WAIT_S = 0.5


class EngineLoop:
    def __init__(self, engine: Engine, identity: DataPlaneIdentity, clock: Clock = SYSTEM_CLOCK) -> None:
        self.engine = engine
        self.identity = identity
        self._clock = clock  # the time submits' deadlines count on
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams = StreamMux()
        self._groups = GroupTable()
        # Submitted requests whose structured-output grammar is compiling (not yet in the engine).
        self._compiling: dict[StreamRequestKey, dataplane_pb2.SubmitCommand] = {}
        self._deadlines: Deadlines[StreamRequestKey] = Deadlines()
        self._arrivals = Arrivals()  # submits not yet taken in: a bounded number per step
        self._kv_event_seq = 0
        self._pending_events: list[dataplane_pb2.KVEvent] = []
        self._stats_dirty = False
        self._draining = False
        self._num_aborted = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._exit_lock = threading.Lock()
        self._exited = False
        self._on_exit: list[Callable[[], None]] = []
        self.fatal_error: BaseException | None = None
        cache_info = {
            "block_size": str(identity.block_size),
            "num_gpu_blocks": str(identity.num_blocks),
            "kv_cache_dtype": identity.kv_cache_dtype,
            "enable_prefix_caching": str(identity.enable_prefix_caching).lower(),
        }
        self.metrics = DataPlaneMetrics(
            engine.stats,
            cache_info,
            lambda: self._num_aborted,
            kernel_info(engine),
            priority_preemptions(engine),
            fair_share_preemptions(engine),
        )

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

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the loop thread) when the loop ends, stopped or failed; at once
        (here) when it already has. For health reporting: a dead loop serves nothing."""
        with self._exit_lock:
            if not self._exited:
                self._on_exit.append(callback)
                return
        callback()

    # -- commands (any thread) -------------------------------------------------------------------
    def connect(self, sink: Sink) -> str:
        """Register a stream; its first response is a snapshot. Returns the stream id."""
        stream_id = self._streams.new_id()
        self._post(lambda: self._on_connect(stream_id, sink))
        return stream_id

    def disconnect(self, stream_id: str) -> None:
        self._post(lambda: self._on_disconnect(stream_id))

    def submit(self, stream_id: str, command: dataplane_pb2.SubmitCommand) -> None:
        # A deadline counts from the arrival here, not from when the loop gets to the command.
        received = self._clock.monotonic()
        self._post(lambda: self._on_submit(stream_id, command, received))

    def abort(self, stream_id: str, request_id: str) -> None:
        self._post(lambda: self._on_abort(StreamRequestKey(stream_id, request_id), notify=True))

    def abort_sample(self, stream_id: str, request_id: str, index: int) -> None:
        """Abort one sample of a request; the others run on (AbortCommand with an index)."""
        self._post(lambda: self._on_abort_sample(StreamRequestKey(stream_id, request_id), index))

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
                busy = self.engine.has_unfinished_requests() or len(self._arrivals) > 0
                self._apply_commands(block=not busy)
                if self._stopped.is_set():
                    break
                for arrival in self._arrivals.take():
                    self._take_in(arrival)
                self._expire()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._flush()
        except BaseException as exc:  # a bug in a step: end every stream loudly, then stop
            self.fatal_error = exc
            log.exception("engine_loop_failed")
        finally:
            self._stopped.set()
            self._streams.close_all()
            with self._exit_lock:
                self._exited = True
                callbacks, self._on_exit = self._on_exit, []
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    log.exception("engine_loop_exit_callback_failed")

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=self._idle_wait_s()) if block else self._inbox.get_nowait()
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
        self.metrics.generated(sum(len(t) for t in result.new_tokens.values()))
        self._stats_dirty = True
        for engine_id, token_ids in result.new_tokens.items():
            sample = self._groups.sample(engine_id)
            group = self._groups.get(sample.key) if sample is not None else None
            if sample is None or group is None:
                continue
            self._streams.outbox(sample.key.stream_id).deltas.append(group.delta(sample.index, token_ids))
        for request in result.finished:
            self._on_sample_finished(request)
        for engine_id, error in result.faulted.items():
            self._on_faulted(engine_id, error)

    def _on_faulted(self, engine_id: str, error: str) -> None:
        """A request whose own work in a step raised (the engine aborted it, blocks freed):
        its stream gets INTERNAL naming the client's request id; the batch went on without it."""
        sample = self._groups.sample(engine_id)
        group = self._groups.get(sample.key) if sample is not None else None
        if sample is None or group is None:
            return
        self.metrics.faulted()
        self._reject(
            sample.key,
            "INTERNAL",
            f"internal error while generating request {sample.key.request_id!r} (it alone failed; "
            f"the server goes on): {error[:200]}",
        )
        self._forget(group)
        self._stats_dirty = True

    def _on_sample_finished(self, request: Request) -> None:
        sample = self._groups.sample(request.request_id)
        group = self._groups.get(sample.key) if sample is not None else None
        if sample is None or group is None or not group.finish(sample.index):
            return
        self._streams.outbox(sample.key.stream_id).finished.append(self._finished(sample, request))
        if group.done:
            self._forget(group)
            self.engine.release(group.engine_id)

    def _finished(self, sample: SampleId, request: Request) -> dataplane_pb2.RequestFinished:
        msg = request_finished(sample, request)
        self.metrics.finished(msg)
        return msg

    def _forget(self, group: Group) -> None:
        group.end_spans()
        self._groups.remove(group)
        self._deadlines.discard(group.key)

    def _flush(self) -> None:
        """Send each stream what this iteration produced for it, plus stats and KV events."""
        records = self.engine.take_kv_events()
        if records:
            self._kv_event_seq = records[-1].seq
            self._pending_events.extend(kv_event_to_proto(r) for r in records)
        if not (self._streams.has_output or self._pending_events or self._stats_dirty):
            return
        self._streams.send(self._stats(), self._pending_events)
        self._pending_events = []
        self._stats_dirty = False

    # -- command handlers (loop thread) ----------------------------------------------------------
    def _on_connect(self, stream_id: str, sink: Sink) -> None:
        self._flush()  # events before the snapshot go to the streams that were there
        self._streams.add(stream_id, sink)
        sink(dataplane_pb2.ConnectResponse(snapshot=self._snapshot()))
        log.info("stream_connected", stream_id=stream_id, streams=len(self._streams))

    def _on_disconnect(self, stream_id: str) -> None:
        if not self._streams.remove(stream_id):
            return
        self._arrivals.discard_stream(stream_id)
        for key in [k for k in self._compiling if k.stream_id == stream_id]:
            del self._compiling[key]
            self._deadlines.discard(key)
        orphans = self._groups.of_stream(stream_id)
        for key in orphans:
            self._on_abort(key, notify=False)
        log.info("stream_closed", stream_id=stream_id, aborted=len(orphans), streams=len(self._streams))

    def _on_submit(self, stream_id: str, command: dataplane_pb2.SubmitCommand, received: float) -> None:
        """Queue the submit (arrivals.py: a bounded number are taken in per step)."""
        if stream_id not in self._streams:
            return
        key = StreamRequestKey(stream_id, command.request_id)
        if self._draining:  # decided as it arrives: what came before the drain is taken in
            return self._reject(key, "UNAVAILABLE", "the data plane is draining")
        if key in self._arrivals:
            return self._reject(
                key, "INVALID_ARGUMENT", f"request_id {key.request_id!r} is already in use on this stream"
            )
        self._arrivals.add(Arrival(key, command, received))

    def _take_in(self, arrival: Arrival) -> None:
        key, command, received = arrival.key, arrival.command, arrival.received

        def reject(code: str, message: str) -> None:
            self._reject(key, code, message)

        if not key.request_id or key in self._groups or key in self._compiling:
            return reject(
                "INVALID_ARGUMENT", f"request_id {key.request_id!r} is empty or already in use on this stream"
            )
        try:
            params = sampling_params_from_proto(command.sampling_params)
            constraint = params.constraint
            grammars = self.engine.grammars() if constraint is not None else None
        except ValueError as exc:  # bad params (or structured outputs without a tokenizer)
            return reject("INVALID_ARGUMENT", str(exc))
        refused = priority_refusal(command.priority) or tenant_refusal(command.tenant, command.tenant_weight)
        if refused is not None:
            return reject("INVALID_ARGUMENT", refused)
        if command.timeout_ms:  # (set from here on: a grammar's compile time counts too)
            self._deadlines.add(key, received + command.timeout_ms / 1000)
        if constraint is None or grammars is None:
            return self._admit(key, command, params, None)
        # Structured output: the grammar compiles off this thread (other requests keep
        # stepping); the request joins the batch when it is ready, or is refused.
        self._compiling[key] = command
        self.metrics.constrained_request(constraint.kind)
        submitted = time.perf_counter()

        def compiled(grammar: object | None, error: Exception | None) -> None:
            self.metrics.grammar_ready(time.perf_counter() - submitted, refused=error is not None)
            self._post(lambda: self._on_compiled(key, command, params, grammar, error))

        grammars.submit(constraint, compiled)

    def _reject(self, key: StreamRequestKey, code: str, message: str) -> None:
        self._streams.outbox(key.stream_id).rejected.append(
            dataplane_pb2.SubmitRejected(request_id=key.request_id, code=code, message=message)
        )

    def _on_compiled(
        self,
        key: StreamRequestKey,
        command: dataplane_pb2.SubmitCommand,
        params: SamplingParams,
        grammar: object | None,
        error: Exception | None,
    ) -> None:
        if self._compiling.get(key) is not command:
            return  # aborted, or its stream closed, while it compiled
        del self._compiling[key]
        if key.stream_id not in self._streams:
            return
        if error is not None or grammar is None:
            self._deadlines.discard(key)
            self._reject(key, "INVALID_ARGUMENT", str(error))
            self._stats_dirty = True
            return
        self._admit(key, command, params, grammar)

    def _admit(
        self,
        key: StreamRequestKey,
        command: dataplane_pb2.SubmitCommand,
        params: SamplingParams,
        grammar: object | None,
    ) -> None:
        try:
            primary = self.engine.add_request(
                list(command.prompt_token_ids),
                params,
                request_id=self._groups.engine_request_id(key),
                cache_salt=command.cache_salt or None,
                grammar=grammar,
                priority=command.priority,
                tenant=command.tenant,
                tenant_weight=wire_weight(command.tenant_weight),
                pooling=pooling_of(command),
            )
        except ValueError as exc:  # a request the scheduler can never run (or bad pooling)
            self._deadlines.discard(key)
            self._reject(key, "INVALID_ARGUMENT", str(exc))
            return
        samples = self.engine.samples_of(primary.request_id)
        group = Group.open(
            key,
            primary.request_id,
            samples,
            wants_logprobs=params.logprobs is not None,
            trace_context=command.trace_context,
            dataplane_id=self.identity.dataplane_id,
        )
        self._groups.add(group)
        self._stats_dirty = True

    def _on_abort(self, key: StreamRequestKey, notify: bool) -> None:
        if self._arrivals.discard(key) or self._compiling.pop(key, None) is not None:
            self._deadlines.discard(key)
            self._num_aborted += 1  # never admitted: no samples to report
            return
        group = self._groups.get(key)
        if group is None:
            return
        self.engine.abort_request(group.engine_id)
        self._num_aborted += 1
        finished = [
            self._finished(SampleId(key, index), request)
            for index, request in enumerate(group.samples)
            if index in group.unfinished
        ]
        if notify:
            self._streams.outbox(key.stream_id).finished.extend(finished)
        self._forget(group)
        self._stats_dirty = True

    def _on_abort_sample(self, key: StreamRequestKey, index: int) -> None:
        """Stop one sample where it is and report it finished (abort), so the control plane's
        count of finished samples still reaches n. Unknown or already finished: nothing (the
        sample may have ended in the step the command crossed)."""
        group = self._groups.get(key)
        if group is None or index not in group.unfinished:
            return
        request = self.engine.abort_sample(group.engine_id, index)
        if request is None or not group.finish(index):
            return
        self._streams.outbox(key.stream_id).finished.append(self._finished(SampleId(key, index), request))
        if group.done:
            self._forget(group)
            self.engine.release(group.engine_id)
        self._stats_dirty = True

    def _expire(self) -> None:
        """Drop every request past its deadline, before the next step schedules it again."""
        for key in self._deadlines.expired(self._clock.monotonic()):
            self._on_deadline(key)

    def _on_deadline(self, key: StreamRequestKey) -> None:
        """`key`'s deadline passed: abort it wherever it is (its blocks freed as on a cancel) and
        refuse it DEADLINE_EXCEEDED, which reaches the client after the tokens it already has."""
        generated = 0
        if self._compiling.pop(key, None) is not None:
            state = "compiling"
        else:
            group = self._groups.get(key)
            if group is None:
                return
            states = {r.status for r in group.samples if not r.status.finished}
            state = next(
                (s.value for s in (RequestStatus.RUNNING, RequestStatus.SWAPPED) if s in states), "waiting"
            )
            generated = sum(r.num_output_tokens for r in group.samples)
            self.engine.abort_request(group.engine_id)
            self._forget(group)
        self._num_aborted += 1
        self.metrics.deadline_exceeded(state)
        log.info("request_deadline_exceeded", request_id=key.request_id, state=state, generated=generated)
        self._reject(
            key,
            "DEADLINE_EXCEEDED",
            f"the request's deadline passed while it was {state} on the data plane, after "
            f"{generated} generated token(s); it was dropped",
        )
        self._stats_dirty = True

    def _idle_wait_s(self) -> float:
        """How long an idle loop may wait for a command: until the soonest deadline at most
        (a request whose grammar compiles is dropped at its deadline, not at the next command)."""
        soonest = self._deadlines.next_deadline()
        return (
            _IDLE_WAIT_S
            if soonest is None
            else min(_IDLE_WAIT_S, max(0.0, soonest - self._clock.monotonic()))
        )

    def _on_drain(self) -> None:
        self._draining = True
        self._stats_dirty = True
        log.info("draining", running=len(self._groups))

    # -- reports --------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._groups)

    def _stats(self) -> dataplane_pb2.PoolStats:
        return pool_stats_to_proto(self.engine.stats(), self._draining, self._num_aborted)

    def _snapshot(self) -> dataplane_pb2.DataPlaneSnapshot:
        return dataplane_pb2.DataPlaneSnapshot(
            info=self.identity.to_proto(),
            stats=self._stats(),
            cached_block_hashes=sorted(self.engine.cached_block_hashes()),
            kv_event_seq=self._kv_event_seq,
        )

    def _state(self) -> dataplane_pb2.GetStateResponse:
        self._flush()
        response = dataplane_pb2.GetStateResponse(snapshot=self._snapshot(), num_streams=len(self._streams))
        for group in self._groups:
            for request in group.samples:
                response.requests.append(
                    dataplane_pb2.RunningRequest(
                        request_id=group.key.request_id,
                        stream_id=group.key.stream_id,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_output_tokens=request.num_output_tokens,
                        num_blocks=len(request.block_table),
                        status=request.status.value,
                    )
                )
        return response
