"""`DataPlaneService` over grpc.aio: streams bridge to the engine loop through asyncio queues."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from pagedserve.common.log import get_logger
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

log = get_logger(__name__)

_DRAIN_POLL_S = 0.05


class DataPlaneServicer(dataplane_pb2_grpc.DataPlaneServiceServicer):
    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    async def Connect(
        self,
        request_iterator: AsyncIterator[dataplane_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext[dataplane_pb2.ConnectRequest, dataplane_pb2.ConnectResponse],
    ) -> AsyncIterator[dataplane_pb2.ConnectResponse]:
        if not self.engine_loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the data plane's engine loop has stopped")
        responses: asyncio.Queue[dataplane_pb2.ConnectResponse | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(message: dataplane_pb2.ConnectResponse | None) -> None:
            # RuntimeError: the event loop is closed, the server is shutting down.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(responses.put_nowait, message)

        stream_id = self.engine_loop.connect(sink)
        reader = asyncio.create_task(self._read_commands(stream_id, request_iterator, responses))
        try:
            while True:
                message = await responses.get()
                if message is None:
                    break
                yield message
            if not self.engine_loop.alive:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the data plane's engine loop has stopped")
        finally:
            # The control plane went away (or the stream ended): abort its requests, free their blocks.
            reader.cancel()
            self.engine_loop.disconnect(stream_id)

    async def _read_commands(
        self,
        stream_id: str,
        request_iterator: AsyncIterator[dataplane_pb2.ConnectRequest],
        responses: asyncio.Queue[dataplane_pb2.ConnectResponse | None],
    ) -> None:
        try:
            async for command in request_iterator:
                kind = command.WhichOneof("command")
                if kind == "submit":
                    self.engine_loop.submit(stream_id, command.submit)
                elif kind == "abort" and command.abort.HasField("index"):
                    self.engine_loop.abort_sample(stream_id, command.abort.request_id, command.abort.index)
                elif kind == "abort":
                    self.engine_loop.abort(stream_id, command.abort.request_id)
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            return
        # The control plane half-closed its side: it is done with this stream.
        responses.put_nowait(None)

    async def GetState(
        self,
        request: dataplane_pb2.GetStateRequest,
        context: grpc.aio.ServicerContext[dataplane_pb2.GetStateRequest, dataplane_pb2.GetStateResponse],
    ) -> dataplane_pb2.GetStateResponse:
        if not self.engine_loop.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the data plane's engine loop has stopped")
        return await asyncio.wrap_future(self.engine_loop.snapshot())

    async def Drain(
        self,
        request: dataplane_pb2.DrainRequest,
        context: grpc.aio.ServicerContext[dataplane_pb2.DrainRequest, dataplane_pb2.DrainResponse],
    ) -> dataplane_pb2.DrainResponse:
        self.engine_loop.set_draining()
        while request.wait and self.engine_loop.num_requests and self.engine_loop.alive:
            await asyncio.sleep(_DRAIN_POLL_S)
        log.info("drain_requested", wait=request.wait, remaining=self.engine_loop.num_requests)
        return dataplane_pb2.DrainResponse(num_remaining=self.engine_loop.num_requests)
