"""Aborts reach a draining data plane. Draining (its PoolStats say `draining`) takes the link
out of placement (`healthy` is false, submit refuses) but the stream stays open and the data
plane runs its requests on: a client's cancel, or one sample's stop, must still go down that
stream so the data plane frees those blocks now. Over a fake data plane on a real gRPC port
that records every command it receives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection
from pagedserve.controlplane.routing.dispatcher import Admitted, Dispatcher
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

WAIT_S = 5.0  # bound on every wait: each is for a message on a local port
INFO = dataplane_pb2.DataPlaneInfo(
    dataplane_id="fake",
    block_size=16,
    num_blocks=64,
    max_model_len=1024,
    max_num_seqs=8,
    prefix_hash_seed="seed",
    abort_sample=True,
)
DRAINING = dataplane_pb2.ConnectResponse(
    stats=dataplane_pb2.PoolStats(total_blocks=64, free_blocks=60, num_running=1, draining=True)
)


class FakeDataPlane(dataplane_pb2_grpc.DataPlaneServiceServicer):
    """Opens each stream with a snapshot, then sends what the test puts on `updates`; every
    command the control plane sends is put on `commands`. The stream stays open throughout."""

    def __init__(self) -> None:
        self.updates: asyncio.Queue[dataplane_pb2.ConnectResponse] = asyncio.Queue()
        self.commands: asyncio.Queue[dataplane_pb2.ConnectRequest] = asyncio.Queue()

    async def Connect(
        self,
        request_iterator: AsyncIterator[dataplane_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext[dataplane_pb2.ConnectRequest, dataplane_pb2.ConnectResponse],
    ) -> AsyncIterator[dataplane_pb2.ConnectResponse]:
        stats = dataplane_pb2.PoolStats(total_blocks=64, free_blocks=64)
        yield dataplane_pb2.ConnectResponse(snapshot=dataplane_pb2.DataPlaneSnapshot(info=INFO, stats=stats))
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while True:
                yield await self.updates.get()
        finally:
            reader.cancel()

    async def _read(self, request_iterator: AsyncIterator[dataplane_pb2.ConnectRequest]) -> None:
        async for command in request_iterator:
            self.commands.put_nowait(command)

    async def next_command(self) -> dataplane_pb2.ConnectRequest:
        return await asyncio.wait_for(self.commands.get(), WAIT_S)


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {WAIT_S}s"
        await asyncio.sleep(0.01)


def with_fake_dataplane(test: Callable[[FakeDataPlane, str], Awaitable[None]]) -> None:
    """Run `test(fake, address)` with the fake serving on an ephemeral local port."""

    async def run() -> None:
        fake = FakeDataPlane()  # type: ignore[abstract]  # (only Connect is called here)
        server = grpc.aio.server()
        dataplane_pb2_grpc.add_DataPlaneServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await test(fake, f"127.0.0.1:{port}")
        finally:
            await server.stop(0)

    asyncio.run(run())


async def connected_link(address: str) -> DataPlaneConnection:
    link = DataPlaneConnection(address, PrefixIndex(), on_change=lambda: None)
    link.start()
    assert await link.wait_connected(WAIT_S), "the link did not connect"
    return link


async def submit_then_drain(
    fake: FakeDataPlane, link: DataPlaneConnection, request_id: str, blocks: int
) -> None:
    """`request_id` goes in flight on `link` (holding `blocks`), then the data plane drains."""
    link.budget.reserve(request_id, blocks)  # as the dispatcher's placement does
    link.submit(dataplane_pb2.SubmitCommand(request_id=request_id))
    assert (await fake.next_command()).submit.request_id == request_id
    fake.updates.put_nowait(DRAINING)
    await wait_for(lambda: link.stats.draining, "the link sees the data plane draining")


def test_a_cancel_reaches_a_draining_data_plane_and_frees_the_reservation() -> None:
    async def test(fake: FakeDataPlane, address: str) -> None:
        link = await connected_link(address)
        try:
            await submit_then_drain(fake, link, "r1", blocks=4)
            assert not link.healthy  # out of placement: it takes nothing new
            with pytest.raises(RuntimeError, match="not connected"):
                link.submit(dataplane_pb2.SubmitCommand(request_id="r2"))
            assert link.budget.reserved_blocks == 4 and list(link.handles) == ["r1"]

            link.abort("r1")  # the client cancelled
            command = await fake.next_command()
            assert command.WhichOneof("command") == "abort"
            assert command.abort.request_id == "r1" and not command.abort.HasField("index")
            assert link.budget.reserved_blocks == 0 and link.handles == {}
            assert fake.commands.empty()  # r2 was never sent
        finally:
            await link.close()

    with_fake_dataplane(test)


def test_a_samples_abort_reaches_a_draining_data_plane_only_while_its_request_runs_there() -> None:
    async def test(fake: FakeDataPlane, address: str) -> None:
        link = await connected_link(address)
        try:
            await submit_then_drain(fake, link, "r1", blocks=4)
            assert link.abort_sample("r1", 1)
            command = await fake.next_command()
            assert command.abort.request_id == "r1" and command.abort.index == 1
            assert list(link.handles) == ["r1"] and link.budget.reserved_blocks == 4  # it runs on

            assert not link.abort_sample("elsewhere", 0)  # not in flight here: nothing is sent
            link.abort("r1")
            assert (await fake.next_command()).abort.request_id == "r1"
            assert not link.abort_sample("r1", 0)  # over: nothing more goes down for it
            assert fake.commands.empty()
        finally:
            await link.close()
        assert not link.abort_sample("r1", 0)  # closed: the stream is gone

    with_fake_dataplane(test)


def test_closing_a_generation_on_a_draining_data_plane_aborts_it_there() -> None:
    """The whole path: the dispatcher places a request, the data plane starts streaming it and
    then drains, the client goes away (the generator is closed): the abort reaches it."""

    async def test(fake: FakeDataPlane, address: str) -> None:
        dispatcher = Dispatcher(ControlPlaneConfig(dataplanes=(address,)))
        await dispatcher.start()
        try:
            assert await dispatcher.wait_ready(WAIT_S)
            link = dispatcher.connections[address]
            request = GenerationRequest("g1", tuple(range(3, 43)), SamplingParams(max_tokens=16))
            events = dispatcher.generate(request)
            admitted = await anext(events)
            assert isinstance(admitted, Admitted) and admitted.dataplane == address
            assert (await fake.next_command()).submit.request_id == "g1"
            assert link.budget.holds("g1")

            fake.updates.put_nowait(
                dataplane_pb2.ConnectResponse(
                    deltas=[dataplane_pb2.TokenDelta(request_id="g1", token_ids=[7])]
                )
            )
            delta = await anext(events)
            assert isinstance(delta, dataplane_pb2.TokenDelta) and list(delta.token_ids) == [7]
            fake.updates.put_nowait(DRAINING)
            await wait_for(lambda: dispatcher.healthy == [], "the dispatcher sees the data plane draining")

            await events.aclose()  # the client went away
            command = await fake.next_command()
            assert command.WhichOneof("command") == "abort" and command.abort.request_id == "g1"
            assert link.handles == {} and link.budget.reserved_blocks == 0
            assert dispatcher.in_progress == 0
        finally:
            await dispatcher.stop()

    with_fake_dataplane(test)
