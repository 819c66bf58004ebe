"""The two planes end to end on tiny models: real gRPC servers on ephemeral ports.

Covers cancellation (blocks come back, on a draining data plane too), INVALID_ARGUMENT /
NOT_FOUND, the max_tokens default (the rest of the context), queue overflow
(RESOURCE_EXHAUSTED), prefix-aware routing and load spreading over two data planes, a data
plane killed mid-stream (UNAVAILABLE within 2 s, later requests succeed on the other) and a
control plane killed mid-load (no data-plane block leaks; a new one serves at once).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from pagedserve.clients.python import AsyncGenerationClient, Completion, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.dataplane import LLM, SamplingParams
from tests.e2e.harness import (
    HeldEngine,
    controlplane_process,
    dataplane_process,
    engine_config,
    get_state,
    start_controlplane,
    start_dataplane,
    wait_idle,
    wait_until_async,
)

LONG = dict(max_tokens=900, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_stream_equals_offline_greedy_and_cancel_frees_every_block(tiny: Path) -> None:
    prompts = [prompt(i, 5 + 7 * i) for i in range(4)]
    llm = LLM(str(tiny), num_gpu_blocks_override=64, max_model_len=1024, num_threads=1)
    offline = [
        o.token_ids
        for o in llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    ]
    del llm

    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                results = await asyncio.gather(
                    *(client.generate(p, max_tokens=40, temperature=0.0, ignore_eos=True) for p in prompts)
                )
                assert [r[0].token_ids for r in results] == offline
                assert [r[0].finish_reason for r in results] == ["length"] * 4
                assert [r[0].prompt_tokens for r in results] == [len(p) for p in prompts]
                assert [r[0].completion_tokens for r in results] == [40] * 4

                # Cancel a long stream after a few chunks: the data plane aborts it and frees its blocks.
                stream = client.generate_stream(prompt(9, 40), **LONG)
                seen = 0
                async for item in stream:
                    assert isinstance(item, StreamChunk)
                    seen += 1
                    if seen == 5:
                        break
                running = await get_state(dp.address)
                assert [r.num_prompt_tokens for r in running.requests] == [40]
                assert running.snapshot.stats.free_blocks < 64
                await stream.aclose()
                idle = await wait_idle(dp.address, timeout_s=5)
                assert idle.snapshot.stats.free_blocks == 64
                assert idle.snapshot.stats.num_aborted_requests == 1
            dp.loop.engine.check_integrity()  # type: ignore[attr-defined]
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_bad_requests_get_invalid_argument_naming_the_field(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=8, max_model_len=256))
        cp = await start_controlplane(tiny, [dp.address])
        cases = [
            ({"max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens"),
            ({"temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
            ({"top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
            ({"stop": [""]}, "INVALID_ARGUMENT", "stop"),
            ({"model": "other-model"}, "NOT_FOUND", "model"),
        ]
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                for kwargs, code, field in cases:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate([5, 6, 7], **kwargs)  # type: ignore[arg-type]
                    assert err.value.code().name == code, kwargs
                    assert field in (err.value.details() or ""), (kwargs, err.value.details())
                prompts = {
                    "prompt.token_ids": [5, 999_999],
                    "prompt.text": "no tokenizer for this model",
                    "max_model_len": list(range(3, 300)),
                }
                for field, bad in prompts.items():
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate(bad, max_tokens=4)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert field in (err.value.details() or ""), err.value.details()
                # Larger than the data plane's whole pool (8 blocks × 16 tokens): refused at once.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(list(range(3, 103)), max_tokens=100, ignore_eos=True)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "whole pool" in (err.value.details() or "")
                # The server keeps serving.
                ok = await client.generate([5, 6, 7], max_tokens=3, temperature=0.0)
                assert ok[0].completion_tokens == 3
            idle = await wait_idle(dp.address)
            assert idle.snapshot.stats.free_blocks == 8
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_unset_max_tokens_generates_to_the_end_of_the_context(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=8, max_model_len=64))
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                out = await client.generate(prompt(7, 10), temperature=0.0, ignore_eos=True)
                assert (out[0].completion_tokens, out[0].finish_reason) == (64 - 10, "length")
            await wait_idle(dp.address)
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_full_admission_queue_is_resource_exhausted(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=64))
        # Each request reserves its prompt block plus 60 decode blocks: one runs, one waits.
        cp = await start_controlplane(tiny, [dp.address], max_queue_len=1, decode_reserve_blocks=60)
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:
                first = client.generate_stream(prompt(1, 8), **LONG)
                got = 0
                async for _ in first:
                    got += 1
                    if got == 120:  # 8 blocks allocated: 56 free < 61 needed
                        break  # (the stream stays open until aclose below)
                queued = asyncio.create_task(client.generate(prompt(2, 8), max_tokens=4))
                await wait_until_async(  # (the first still has ~780 tokens to go)
                    lambda: len(cp.dispatcher.admission) >= 1 or queued.done(), what="the second one queues"
                )
                assert not queued.done()  # the second one waits ...
                with pytest.raises(grpc.aio.AioRpcError) as err:  # ... so a third finds the queue full
                    await client.generate(prompt(3, 8), max_tokens=4)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "retry in" in (err.value.details() or "")
                trailers = dict(err.value.trailing_metadata() or ())
                assert float(trailers["retry-after"]) >= 1
                await first.aclose()  # cancels the first: its blocks return, the queued one runs
                result = await asyncio.wait_for(queued, 20)
                assert result[0].completion_tokens == 4
            await wait_idle(dp.address)
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


async def _drain(stream):  # type: ignore[no-untyped-def]
    async for _ in stream:
        pass


def test_shared_prefix_goes_to_the_data_plane_that_caches_it_and_load_spreads(tiny: Path) -> None:
    async def run() -> None:
        dps = [await start_dataplane(engine_config(tiny, num_blocks=128), name=f"dp{i}") for i in range(2)]
        cp = await start_controlplane(tiny, [d.address for d in dps])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                shared = prompt(100, 96)  # 6 full blocks
                await client.generate([*shared, 7], max_tokens=2, temperature=0.0)
                stats = [d.loop.engine.kv_cache.prefix_cache_stats for d in dps]  # type: ignore[attr-defined]
                owner = next(i for i, s in enumerate(stats) if s.requests == 1)
                other = 1 - owner
                await wait_until_async(  # its 6 full blocks
                    lambda: cp.dispatcher.index.num_blocks(dps[owner].address) >= 6,
                    what="the owner's KV events reach the control plane's index",
                )
                for suffix in range(4):
                    out = await client.generate([*shared, 10 + suffix, 11], max_tokens=2, temperature=0.0)
                    assert out[0].cached_tokens == 96
                assert stats[owner].requests == 5 and stats[owner].hits == 4 * 96
                assert stats[other].requests == 0

                # Unrelated prompts, all at once: both data planes take a share.
                unrelated = [prompt(200 + i, 20) for i in range(8)]
                await asyncio.gather(*(client.generate(p, max_tokens=24, temperature=0.0) for p in unrelated))
                assert stats[other].requests >= 2, (stats[owner].requests, stats[other].requests)
                assert stats[owner].requests >= 5 + 2
            for d in dps:
                await wait_idle(d.address)
        finally:
            await cp.stop()
            for d in dps:
                await d.stop()

    asyncio.run(run())


def test_killed_data_plane_fails_streams_fast_and_the_other_serves(tiny: Path) -> None:
    procs = [dataplane_process(tiny), dataplane_process(tiny)]

    async def run() -> None:
        cp = await start_controlplane(tiny, [p.address for p in procs])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                stream = client.generate_stream(prompt(5, 10), **LONG)
                got = 0
                async for _ in stream:
                    got += 1
                    if got == 3:
                        break  # (and resume below)
                states = [await get_state(p.address) for p in procs]
                victim = next(i for i, s in enumerate(states) if s.requests)
                procs[victim].kill()
                # Fast: the link's own end fails the stream ("went away"), not a keepalive
                # timeout or the call's deadline, whose errors would read otherwise.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for item in stream:
                        assert not isinstance(item, Completion)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "went away" in (err.value.details() or "")
                survivor = procs[1 - victim]
                for i in range(3):
                    out = await client.generate(prompt(50 + i, 12), max_tokens=5, temperature=0.0)
                    assert out[0].completion_tokens == 5
                await wait_idle(survivor.address)
        finally:
            await cp.stop()

    try:
        asyncio.run(run())
    finally:
        for p in procs:
            p.kill()


def test_control_plane_killed_mid_load_leaks_nothing_and_a_new_one_serves(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny, num_blocks=256))
        first = controlplane_process(tiny, [dp.address])
        try:
            client = AsyncGenerationClient(first.address)
            streams = [
                asyncio.create_task(_drain(client.generate_stream(prompt(i, 30), **LONG))) for i in range(4)
            ]

            async def all_running() -> bool:
                assert not any(t.done() for t in streams), [t for t in streams if t.done()]
                return (await get_state(dp.address)).snapshot.stats.num_running >= 4

            await wait_until_async(all_running, 30, "the 4 streams run on the data plane")
            first.kill()
            for task in streams:
                with pytest.raises(grpc.aio.AioRpcError):
                    await task
            await client.close()
            idle = await wait_idle(dp.address, timeout_s=5)
            assert idle.num_streams == 0
            second = controlplane_process(tiny, [dp.address])
            try:
                async with AsyncGenerationClient(second.address) as client2:
                    out = await client2.generate(prompt(1, 30), max_tokens=6, temperature=0.0)
                    assert out[0].completion_tokens == 6
                await wait_idle(dp.address)
            finally:
                second.kill()
        finally:
            first.kill()
            await dp.stop()

    asyncio.run(run())


def test_request_that_streamed_nothing_is_rerouted_when_its_data_plane_dies(tiny: Path) -> None:
    async def run() -> None:
        dps = [await start_dataplane(engine_config(tiny), name=f"dp{i}") for i in range(2)]
        cp = await start_controlplane(tiny, [d.address for d in dps])
        first = min(dps, key=lambda d: d.address)  # idle tie: the router picks the lower address
        other = dps[1 - dps.index(first)]
        held = HeldEngine(first.loop)
        try:
            # Part of the scenario, not a wait: its engine is held, so nothing streams yet.
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                task = asyncio.create_task(client.generate(prompt(3, 12), max_tokens=6, temperature=0.0))
                await wait_until_async(lambda: _handles(cp), what="the request is submitted")
                assert first.address in {h.connection.address for h in _handles(cp)}
                await first.server.stop(0)  # the data plane goes away before its first token
                out = await asyncio.wait_for(task, 20)
                assert out[0].completion_tokens == 6
            assert other.loop.engine.kv_cache.prefix_cache_stats.requests == 1  # type: ignore[attr-defined]
            await wait_idle(other.address)
        finally:
            held.release()
            await cp.stop()
            for d in dps:
                await d.stop()

    asyncio.run(run())


def _handles(cp):  # type: ignore[no-untyped-def]
    return [h for link in cp.dispatcher.connections.values() for h in link.handles.values()]


def test_draining_data_plane_takes_no_new_requests(tiny: Path) -> None:
    from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with grpc.aio.insecure_channel(dp.address) as channel:
                stub = dataplane_pb2_grpc.DataPlaneServiceStub(channel)
                drained = await stub.Drain(dataplane_pb2.DrainRequest(wait=True), timeout=10)
                assert drained.num_remaining == 0
            await wait_until_async(
                lambda: cp.dispatcher.healthy == [], what="the control plane sees the data plane draining"
            )
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate([5, 6, 7], max_tokens=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no data plane" in (err.value.details() or "")
            assert (await get_state(dp.address)).snapshot.stats.draining
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_a_cancel_reaches_a_draining_data_plane_and_frees_its_blocks(tiny: Path) -> None:
    from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                stream = client.generate_stream(prompt(11, 40), **LONG)
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen == 3:
                        break
                async with grpc.aio.insecure_channel(dp.address) as channel:
                    stub = dataplane_pb2_grpc.DataPlaneServiceStub(channel)
                    drained = await stub.Drain(dataplane_pb2.DrainRequest(wait=False), timeout=5)
                    assert drained.num_remaining == 1
                await wait_until_async(
                    lambda: cp.dispatcher.healthy == [], what="the control plane sees the data plane draining"
                )
                assert len((await get_state(dp.address)).requests) == 1  # it still runs there
                await stream.aclose()  # the client cancels: the abort must reach the draining data plane
                idle = await wait_idle(dp.address, timeout_s=5)
                assert idle.snapshot.stats.draining
                assert idle.snapshot.stats.free_blocks == 64
                assert idle.snapshot.stats.num_aborted_requests == 1  # aborted, not run to its end
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_dataplanes_discovered_by_dns(tiny: Path) -> None:
    from pagedserve.controlplane.routing.discovery import resolve_dataplanes

    async def run() -> None:
        assert "127.0.0.1:5" in await resolve_dataplanes("localhost:5")
        dp = await start_dataplane(engine_config(tiny))
        cp = await start_control_plane_dns(tiny, f"localhost:{dp.port}")
        try:
            assert dp.address in cp.dispatcher.connections
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                out = await client.generate([5, 6, 7], max_tokens=3, temperature=0.0)
                assert out[0].completion_tokens == 3
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


async def start_control_plane_dns(tiny: Path, name: str):  # type: ignore[no-untyped-def]
    from pagedserve.controlplane.config import ControlPlaneConfig
    from pagedserve.controlplane.server import start_control_plane

    config = ControlPlaneConfig(model=str(tiny), dataplane_dns=name, dns_refresh_s=0.2)
    cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
    assert await cp.dispatcher.wait_ready(10.0)
    return cp


def test_deadline_ends_the_call_and_frees_its_blocks(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(prompt(4, 10), timeout=0.5, **LONG)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            idle = await wait_idle(dp.address, timeout_s=5)
            assert idle.snapshot.stats.num_aborted_requests == 1
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())
