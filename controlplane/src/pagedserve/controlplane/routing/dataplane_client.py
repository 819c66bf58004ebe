"""One control-plane replica's link to one data plane: the long-lived bidi stream.

Everything the control plane knows about a data plane comes through here: the snapshot that
opens each stream (its configuration, free blocks, cached hashes), then per-step updates
(token deltas, finishes, rejections, pool stats, KV events). Submits and aborts go down the
same stream. When the stream breaks, every request in flight on it gets a `Lost` event
(the dispatcher re-routes those that have streamed nothing), the data plane leaves the
routing set, and the link reconnects with backoff; the new stream's snapshot brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pagedserve.common.grpc_options import LINK_CHANNEL_OPTIONS
from pagedserve.common.log import get_logger
from pagedserve.common.tls import ClientTLS, token_metadata
from pagedserve.controlplane.routing.budget import BlockBudget
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

log = get_logger(__name__)


@dataclass(frozen=True)
class Lost:
    """The stream to the data plane broke while the request was in flight."""

    message: str


RequestEvent = dataplane_pb2.TokenDelta | dataplane_pb2.RequestFinished | dataplane_pb2.SubmitRejected | Lost


class RequestHandle:
    """A request in flight on one data plane: its events arrive on `events`, in order."""

    def __init__(
        self, request_id: str, connection: DataPlaneConnection, priority: int = 0, tenant: str = ""
    ) -> None:
        self.request_id = request_id
        self.connection = connection
        self.priority = priority  # (placement: a better one may preempt it there)
        self.tenant = tenant  # (placement: the tenant's share of the batch there)
        self.events: asyncio.Queue[RequestEvent] = asyncio.Queue()


class DataPlaneConnection:
    def __init__(
        self,
        address: str,
        index: PrefixIndex,
        on_change: Callable[[], None],
        backoff_s: float = 0.2,
        backoff_max_s: float = 2.0,
        tls: ClientTLS | None = None,
        token: str | None = None,
    ) -> None:
        self.address = address
        self.tls = tls
        self._metadata = token_metadata(token)  # the data plane's shared token, on every call
        self.index = index
        self.on_change = on_change
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.info: dataplane_pb2.DataPlaneInfo | None = None
        self.stats = dataplane_pb2.PoolStats()
        self.budget = BlockBudget()
        self.healthy = False
        self.handles: dict[str, RequestHandle] = {}
        self.num_finished = 0  # completions this replica saw finish here (for metrics and doctor)
        self._outgoing: asyncio.Queue[dataplane_pb2.ConnectRequest | None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self._close_reason = "the control plane is shutting down"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.tls is not None:
            options = [*LINK_CHANNEL_OPTIONS, *self.tls.channel_options()]
            self._channel = grpc.aio.secure_channel(self.address, self.tls.credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=LINK_CHANNEL_OPTIONS)
        self._task = asyncio.create_task(self._run(), name=f"dataplane-link-{self.address}")

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.healthy

    @property
    def closing(self) -> bool:
        """close() was called: the link takes no more requests."""
        return self._closed

    async def close(self, reason: str = "the control plane is shutting down") -> None:
        """End the link: requests still in flight get `Lost` with `reason`."""
        self._closed = True
        self._close_reason = reason
        self.healthy = False  # at once: nothing is placed here any more
        if self._outgoing is not None:
            self._outgoing.put_nowait(None)  # half-close: the data plane aborts our requests
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._channel is not None:
            await self._channel.close()

    async def get_state(self, timeout_s: float = 5.0) -> dataplane_pb2.GetStateResponse:
        assert self._channel is not None, "start() first"
        stub = dataplane_pb2_grpc.DataPlaneServiceStub(self._channel)
        return await stub.GetState(
            dataplane_pb2.GetStateRequest(), timeout=timeout_s, metadata=self._metadata
        )

    # -- requests -------------------------------------------------------------------------------
    def submit(self, command: dataplane_pb2.SubmitCommand) -> RequestHandle:
        """Send a request to the data plane; its events arrive on the returned handle."""
        if not self.healthy or self._outgoing is None:
            raise RuntimeError(f"data plane {self.address} is not connected")
        handle = RequestHandle(command.request_id, self, command.priority, command.tenant)
        self.handles[command.request_id] = handle
        self._outgoing.put_nowait(dataplane_pb2.ConnectRequest(submit=command))
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string matched); its reservation is released.
        Sent to a draining data plane too: it still runs the request, and the abort frees its
        blocks there now rather than when the request would have ended."""
        self._send_abort(dataplane_pb2.AbortCommand(request_id=request_id))
        self.handles.pop(request_id, None)
        self.budget.release(request_id)
        self.on_change()

    def abort_sample(self, request_id: str, index: int) -> bool:
        """Stop one sample of a request in flight here (it matched a stop string) while the
        others run on; the request keeps its reservation. Sent only to a data plane that says
        it honours a sample's abort (an older one would abort them all). False when not sent:
        the sample then runs to its end and its events are dropped."""
        if self.info is None or not self.info.abort_sample:
            return False
        return self._send_abort(dataplane_pb2.AbortCommand(request_id=request_id, index=index))

    def _send_abort(self, abort: dataplane_pb2.AbortCommand) -> bool:
        """Send `abort` if its request is in flight here and the stream is open; False if not.

        Not gated on `healthy`: that says whether new work may be placed here, and a draining
        data plane takes none, yet it runs its requests to their end on the same stream. (A
        request in `handles` is on the current stream: a broken one takes them all with it.)
        After close() the half-close is queued, so nothing more can go down the stream."""
        if abort.request_id not in self.handles or self._outgoing is None or self._closed:
            return False
        self._outgoing.put_nowait(dataplane_pb2.ConnectRequest(abort=abort))
        return True

    def finish(self, request_id: str) -> None:
        """The request's last event was consumed."""
        self.handles.pop(request_id, None)
        self.budget.release(request_id)

    # -- the stream -----------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = self.backoff_s
        assert self._channel is not None
        stub = dataplane_pb2_grpc.DataPlaneServiceStub(self._channel)
        while not self._closed:
            outgoing: asyncio.Queue[dataplane_pb2.ConnectRequest | None] = asyncio.Queue()
            self._outgoing = outgoing
            reason = "stream ended"
            # Commands go down through our own writer task (not a request iterator handed to
            # grpc): this stream owns it and ends it, so a broken stream leaves no task behind.
            call = stub.Connect(metadata=self._metadata)
            writer = asyncio.create_task(self._write(call, outgoing), name=f"dataplane-writer-{self.address}")
            try:
                async for response in call:
                    if response.HasField("snapshot"):
                        self._on_snapshot(response.snapshot)
                        backoff = self.backoff_s
                    else:
                        await self._on_update(response)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                self._lost(self._close_reason)
                raise
            finally:
                writer.cancel()
                call.cancel()
                await asyncio.wait({writer})
            self._lost(reason)
            if self._closed:
                break
            await asyncio.sleep(backoff)
            backoff = min(self.backoff_max_s, backoff * 2)

    @staticmethod
    async def _write(
        call: grpc.aio.StreamStreamCall[dataplane_pb2.ConnectRequest, dataplane_pb2.ConnectResponse],
        outgoing: asyncio.Queue[dataplane_pb2.ConnectRequest | None],
    ) -> None:
        """Send the queued commands down the stream; None half-closes it. Ends quietly when the
        stream has ended (the reader reports why)."""
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            while True:
                command = await outgoing.get()
                if command is None:
                    await call.done_writing()
                    return
                await call.write(command)

    def _on_snapshot(self, snapshot: dataplane_pb2.DataPlaneSnapshot) -> None:
        self.info = snapshot.info
        self.stats = snapshot.stats
        self.budget.clear()
        self.budget.report(snapshot.stats.free_blocks, snapshot.stats.total_blocks)
        self.index.load_snapshot(self.address, snapshot.cached_block_hashes, snapshot.kv_event_seq)
        was_healthy, self.healthy = self.healthy, not snapshot.stats.draining
        self._connected.set()
        if not was_healthy:
            log.info(
                "dataplane_joined",
                address=self.address,
                dataplane_id=snapshot.info.dataplane_id,
                blocks=snapshot.info.num_blocks,
                cached_blocks=len(snapshot.cached_block_hashes),
            )
        self.on_change()

    async def _on_update(self, response: dataplane_pb2.ConnectResponse) -> None:
        for delta in response.deltas:
            handle = self.handles.get(delta.request_id)
            if handle is not None:
                self.budget.release(delta.request_id)  # the data plane's report now covers it
                handle.events.put_nowait(delta)
        self.num_finished += len(response.finished)
        for finished in response.finished:
            handle = self.handles.get(finished.request_id)
            if handle is not None:
                self.budget.release(finished.request_id)
                handle.events.put_nowait(finished)
        for rejected in response.rejected:
            handle = self.handles.pop(rejected.request_id, None)
            self.budget.release(rejected.request_id)
            if handle is not None:
                handle.events.put_nowait(rejected)
        if response.HasField("stats"):
            self.stats = response.stats
            self.budget.report(response.stats.free_blocks, response.stats.total_blocks)
            if response.stats.draining and self.healthy:
                self.healthy = False
                log.info("dataplane_draining", address=self.address)
        if response.kv_events and not self.index.apply_events(self.address, response.kv_events):
            await self._resync()
        self.on_change()

    async def _resync(self) -> None:
        """A KV-event gap: rebuild this data plane's index entry from GetState."""
        log.warning("kv_event_gap", address=self.address)
        try:
            state = await self.get_state()
        except grpc.aio.AioRpcError as exc:
            log.warning("resync_failed", address=self.address, error=exc.code().name)
            return
        self.index.load_snapshot(
            self.address, state.snapshot.cached_block_hashes, state.snapshot.kv_event_seq
        )

    def _lost(self, reason: str) -> None:
        was_healthy = self.healthy
        self.healthy = False
        self._connected.clear()
        self._outgoing = None
        self.index.drop(self.address)
        self.budget.clear()
        handles, self.handles = self.handles, {}
        for handle in handles.values():
            handle.events.put_nowait(Lost(f"data plane {self.address} went away ({reason})"))
        if was_healthy or handles:
            log.warning("dataplane_lost", address=self.address, reason=reason, in_flight=len(handles))
        self.on_change()
