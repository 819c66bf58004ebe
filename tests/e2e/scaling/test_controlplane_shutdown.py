"""A control plane stopped by SIGTERM (a rollout, a scale-down) lets its streams finish.

On SIGTERM it reports NOT_SERVING on gRPC health and 503 on /health at once, refuses new
requests with UNAVAILABLE (the client retries another replica), lets the running streams finish
within `shutdown_grace_s`, then exits 0. The data plane runs in this process with a slowed
engine, so the stream is still running while the test checks all that; the control plane is a
real process. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.clients.python import AsyncGenerationClient, Completion, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from tests.e2e.harness import (
    DataPlane,
    controlplane_process,
    engine_config,
    get_state,
    start_controlplane,
    start_dataplane,
    wait_idle,
    wait_until_async,
)

TOKENS = 300


def slow_down(dp: DataPlane, seconds: float) -> None:
    """Every engine step of `dp` takes `seconds` longer (in its loop thread): long streams."""
    step = dp.loop.engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return step()

    dp.loop.engine.step = slow_step  # type: ignore[method-assign]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(response.status)


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_requests(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        slow_down(dp, 0.01)  # the stream takes seconds: SIGTERM lands in the middle
        cp = controlplane_process(tiny, [dp.address])
        try:
            match = re.search(r"HTTP on (\S+)", cp.line)
            assert match is not None, cp.line
            health_url = f"{match.group(1)}/health"
            await wait_until_async(lambda: _serving(cp.address), 20, "the control plane is serving")
            assert await asyncio.to_thread(http_status, health_url) == 200
            async with AsyncGenerationClient(cp.address, retry=NO_RETRY) as client:
                prompt = [5, 6, 7, 8]
                stream = client.generate_stream(prompt, max_tokens=TOKENS, ignore_eos=True)
                tokens = 0
                async for item in stream:
                    assert isinstance(item, StreamChunk)
                    tokens += len(item.token_ids)
                    break  # streaming; read on below

                cp.proc.send_signal(signal.SIGTERM)
                await wait_until_async(
                    lambda: _not_serving(cp.address), 10, "gRPC health turns NOT_SERVING after SIGTERM"
                )
                assert await asyncio.to_thread(http_status, health_url) == 503
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(prompt, max_tokens=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in (err.value.details() or "")
                assert (await get_state(dp.address)).requests  # the first stream was still running

                completion = None
                async for item in stream:
                    if isinstance(item, Completion):
                        completion = item
                    else:
                        tokens += len(item.token_ids)
                assert completion is not None
                assert (completion.completion_tokens, completion.finish_reason) == (TOKENS, "length")
                assert tokens == TOKENS
            assert await asyncio.to_thread(cp.proc.wait, 30) == 0
            idle = await wait_idle(dp.address, timeout_s=10)
            assert idle.num_streams == 0
        finally:
            cp.kill()
            await dp.stop()

    asyncio.run(run())


async def _serving(address: str) -> bool:
    return await health_status(address) == health_pb2.HealthCheckResponse.SERVING


async def _not_serving(address: str) -> bool:
    return await health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_streams_longer_than_the_grace_are_cut_when_it_ends(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        slow_down(dp, 0.02)
        cp = await start_controlplane(tiny, [dp.address])
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:
                task = asyncio.create_task(client.generate([5, 6, 7], max_tokens=TOKENS, ignore_eos=True))
                await wait_until_async(lambda: cp.dispatcher.in_progress == 1, 10, "the stream runs")
                started = time.monotonic()
                assert await cp.shutdown(grace_s=0.5) is False  # the stream needs ~6 s
                assert 0.4 < time.monotonic() - started < 5.0
                with pytest.raises(grpc.aio.AioRpcError):
                    await asyncio.wait_for(task, 10)
            await wait_idle(dp.address, timeout_s=10)  # its blocks came back
        finally:
            await dp.stop()

    asyncio.run(run())
