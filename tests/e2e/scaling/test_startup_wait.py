"""No failing start-up window: a request that reaches the control plane before any data plane
has served waits for one (bounded by `--dataplane-wait`, or the call's deadline) and then runs;
with none within the bound it fails with the same UNAVAILABLE as before. Real control and data
planes in process, a tiny model; the waits are observed through the dispatcher's count of
waiting requests, not by sleeping."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.clients.python import GenerationClient
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.common.lifecycle import free_port
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.routing.placement import NO_DATAPLANE
from pagedserve.controlplane.server import ControlPlane, start_control_plane
from pagedserve.dataplane.server.server import build_engine_loop, create_server
from tests.e2e.harness import engine_config, wait_until_async


async def control_plane(model: Path, port: int, **kw: Any) -> ControlPlane:
    config = ControlPlaneConfig(
        model=str(model), dataplanes=(f"127.0.0.1:{port}",), reconnect_backoff_max_s=0.2, **kw
    )
    return await start_control_plane(config, "127.0.0.1", 0, http_port=0)


def grpc_generate(cp: ControlPlane) -> Any:
    with GenerationClient(f"127.0.0.1:{cp.grpc_port}", timeout=120, retry=NO_RETRY) as client:
        return client.generate([5, 6, 7], max_tokens=2)[0]


def http_generate(cp: ControlPlane) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{cp.http_port}/v1/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_requests_sent_before_the_data_plane_wait_for_it_then_run(tiny: Path) -> None:
    async def scenario() -> None:
        port = free_port()
        cp = await control_plane(tiny, port)
        engine = None
        server = None
        try:
            over_grpc = asyncio.ensure_future(asyncio.to_thread(grpc_generate, cp))
            over_http = asyncio.ensure_future(asyncio.to_thread(http_generate, cp))
            await wait_until_async(
                lambda: cp.dispatcher.waiting_for_startup == 2, 30, "both requests waiting"
            )
            assert not over_grpc.done() and not over_http.done()
            engine = build_engine_loop(engine_config(tiny, num_blocks=32, max_model_len=128), "late")
            server, _ = await create_server(engine, f"127.0.0.1:{port}")
            completion = await asyncio.wait_for(over_grpc, 60)
            status, body = await asyncio.wait_for(over_http, 60)
            assert completion.completion_tokens == 2
            assert status == 200 and body["usage"]["completion_tokens"] == 2, body
            assert cp.dispatcher.waiting_for_startup == 0
        finally:
            await cp.stop()
            if server is not None:
                await server.stop(0)
            if engine is not None:
                engine.stop()

    asyncio.run(scenario())


def test_with_no_data_plane_within_the_bound_a_request_fails_unavailable(tiny: Path) -> None:
    async def scenario() -> None:
        cp = await control_plane(tiny, free_port(), dataplane_wait_s=0.3)
        try:
            with pytest.raises(grpc.RpcError) as failed:
                await asyncio.to_thread(grpc_generate, cp)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert NO_DATAPLANE in failed.value.details()
            status, body = await asyncio.to_thread(http_generate, cp)
            assert status == 503 and NO_DATAPLANE in body["error"]["message"], body
        finally:
            await cp.stop()

    asyncio.run(scenario())


def dispatcher(**kw: Any) -> Dispatcher:
    return Dispatcher(ControlPlaneConfig(dataplanes=("127.0.0.1:1",), **kw))  # never started: no link


def test_the_wait_ends_at_the_requests_deadline_and_at_once_on_shutdown() -> None:
    async def scenario() -> None:
        d = dispatcher(dataplane_wait_s=3600)
        started = time.monotonic()
        await asyncio.wait_for(d.wait_for_startup(deadline=time.monotonic() + 0.05), 30)
        assert time.monotonic() - started < 30  # the deadline, not the hour
        waiter = asyncio.ensure_future(d.wait_for_startup())
        await wait_until_async(lambda: d.waiting_for_startup == 1, 10, "waiting")
        d.stop_accepting()  # shutdown: nothing will come, the waiter goes on (to be refused)
        await asyncio.wait_for(waiter, 10)
        assert d.waiting_for_startup == 0
        await d.wait_for_startup()  # and nothing waits from then on

    asyncio.run(scenario())


def test_nothing_waits_with_a_zero_bound() -> None:
    async def scenario() -> None:
        await asyncio.wait_for(dispatcher(dataplane_wait_s=0).wait_for_startup(), 10)

    asyncio.run(scenario())
