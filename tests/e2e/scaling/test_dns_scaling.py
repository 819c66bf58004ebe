"""Scaling without restarts: data planes found by DNS join and leave a running control plane.

The control plane runs in this process with an injected resolver (`Dispatcher(config,
resolver=...)`), so a test "scales" by changing what the name resolves to; the data planes are
real. One data plane, then three: traffic spreads to all three. Back to one while streams run
on the other two: those two take no new request, their streams finish (exact token counts, no
failure), then their links close and their pools are all free. A data plane that comes back
while it drains is back in rotation on the same link; one whose streams outlive
`dataplane_drain_timeout_s` is cut. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.clients.python import AsyncGenerationClient
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.server import ControlPlane, start_control_plane
from tests.e2e.harness import (
    DataPlane,
    Process,
    dataplane_process,
    engine_config,
    get_state,
    start_dataplane,
    wait_idle,
    wait_until_async,
)

DNS_NAME = "pagedserve-dataplane.test.svc.cluster.local:50052"
# Tokens per long stream: seconds of decoding, so scaling happens while they run (the tiny model
# decodes a token in ~2 ms, so 600 tokens once took seconds and now take ~1 s: too short).
LONG = 3000
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=MAX_MODEL_LEN
    )


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


class FakeDNS:
    """The injected resolver: the headless Service's name resolves to `addresses`, whatever
    they are now."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self.lookups = 0

    async def __call__(self, name: str) -> list[str]:
        assert name == DNS_NAME
        self.lookups += 1
        return sorted(self.addresses)


async def start_cp(tiny_long: Path, dns: FakeDNS, **kw: Any) -> ControlPlane:
    config = ControlPlaneConfig(model=str(tiny_long), dataplane_dns=DNS_NAME, dns_refresh_s=0.1, **kw)
    return await start_control_plane(config, "127.0.0.1", 0, http_port=None, resolver=dns)


def start_processes(tiny_long: Path, n: int) -> list[Process]:
    """`n` data-plane processes, started side by side (each imports torch and loads the model)."""
    with ThreadPoolExecutor(n) as pool:
        # Each takes 2 long streams: 2 x (12 + LONG) tokens in blocks of 16, with room to spare.
        futures = [pool.submit(dataplane_process, tiny_long, 512, MAX_MODEL_LEN) for _ in range(n)]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < n:
        for p in started:
            p.kill()
        raise next(e for f in futures if (e := f.exception()) is not None)
    return started


def healthy(cp: ControlPlane) -> set[str]:
    return {link.address for link in cp.dispatcher.healthy}


def test_scale_up_spreads_traffic_and_scale_down_drains_every_stream(tiny_long: Path) -> None:
    procs = start_processes(tiny_long, 3)
    try:
        asyncio.run(_scale_up_then_down(tiny_long, sorted(p.address for p in procs)))
    finally:
        for p in procs:
            p.kill()


async def _scale_up_then_down(tiny_long: Path, addresses: list[str]) -> None:
    first, *others = addresses
    dns = FakeDNS([first])
    cp = await start_cp(tiny_long, dns)
    dispatcher = cp.dispatcher
    try:
        assert await dispatcher.wait_ready(20.0)
        assert set(dispatcher.connections) == {first}

        # Scale up: the next refresh finds two more; they join without a restart.
        dns.addresses = list(addresses)
        await wait_until_async(lambda: healthy(cp) == set(addresses), 20, "the two new data planes join")
        links = {a: dispatcher.connections[a] for a in addresses}

        async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:
            longs = [
                asyncio.create_task(
                    client.generate(prompt(i, 12), max_tokens=LONG, temperature=0.0, ignore_eos=True)
                )
                for i in range(6)
            ]
            await wait_until_async(
                lambda: (
                    sum(len(link.handles) for link in links.values()) == 6 or any(t.done() for t in longs)
                ),
                20,
                "the 6 streams are submitted",
            )
            assert not any(t.done() for t in longs), [t for t in longs if t.done()]
            # Traffic spread: every data plane runs some of the streams (its own view, GetState).
            for address in addresses:
                assert links[address].handles, {a: len(link.handles) for a, link in links.items()}

                async def runs_some(address: str = address) -> bool:
                    # A stream the control plane has sent reaches the engine a moment later.
                    return bool((await get_state(address)).requests)

                await wait_until_async(runs_some, 20, f"{address} runs some of the streams")

            # Scale down to one while streams run on the other two: they drain.
            dns.addresses = [first]
            await wait_until_async(
                lambda: dispatcher.retiring == set(others), 10, "the removed data planes retire"
            )
            in_flight = {a: len(links[a].handles) for a in others}
            assert all(in_flight.values()), f"streams already over: {in_flight}"  # drained, not idle
            served = {a: links[a].num_finished + in_flight[a] for a in others}  # all they will ever run
            assert healthy(cp) == {first}
            assert not any(links[a].closing for a in others)

            # New requests go to the one left, and succeed.
            shorts = await asyncio.gather(
                *(client.generate(prompt(100 + i, 8), max_tokens=5, temperature=0.0) for i in range(4))
            )
            assert [s[0].completion_tokens for s in shorts] == [5] * 4

            # Every stream completes, exactly, on the data plane it started on.
            results = await asyncio.wait_for(asyncio.gather(*longs), 180)
            assert [(r[0].completion_tokens, r[0].finish_reason) for r in results] == [(LONG, "length")] * 6

        # Drained: the two links close and leave the set; nothing new ever went there.
        await wait_until_async(
            lambda: set(dispatcher.connections) == {first} and not dispatcher.retiring,
            10,
            "the drained links close",
        )
        for address in others:
            assert links[address].closing
            assert links[address].num_finished == served[address]
        assert links[first].num_finished == 6 - sum(served.values()) + 4
        assert not links[first].closing and healthy(cp) == {first}

        # Their pools are all free again, and the data planes saw their stream close.
        for address in addresses:
            idle = await wait_idle(address, timeout_s=10)
            assert idle.snapshot.stats.prefix_cache_queries > 0  # it served requests
        for address in others:
            await wait_until_async(
                functools.partial(_num_streams, address), 10, f"{address} sees the control plane's link close"
            )
    finally:
        await cp.stop()


async def _num_streams(address: str) -> bool:
    return (await get_state(address)).num_streams == 0


def slow_down(dp: DataPlane, seconds: float) -> None:
    """Every engine step of `dp` takes `seconds` longer (in its loop thread): long streams."""
    step = dp.loop.engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return step()

    dp.loop.engine.step = slow_step  # type: ignore[method-assign]


def test_a_data_plane_back_in_dns_returns_and_one_that_drains_too_long_is_cut(tiny_long: Path) -> None:
    async def run() -> None:
        dps = [
            await start_dataplane(engine_config(tiny_long, num_blocks=128), name=f"dp{i}") for i in range(2)
        ]
        for dp in dps:
            slow_down(dp, 0.02)
        a, b = sorted(d.address for d in dps)
        dns = FakeDNS([a, b])
        cp = await start_cp(tiny_long, dns, dataplane_drain_timeout_s=1.0)
        dispatcher = cp.dispatcher
        try:
            await wait_until_async(lambda: healthy(cp) == {a, b}, 20, "both data planes join")
            link_b = dispatcher.connections[b]
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:
                streams = [
                    asyncio.create_task(
                        client.generate(prompt(i, 10), max_tokens=300, temperature=0.0, ignore_eos=True)
                    )
                    for i in range(2)
                ]
                await wait_until_async(
                    lambda: all(dispatcher.connections[x].handles for x in (a, b)), 20, "one stream on each"
                )
                (on_b,) = link_b.handles

                # b leaves DNS and comes back before its stream ends: the same link, in rotation.
                dns.addresses = [a]
                await wait_until_async(lambda: dispatcher.retiring == {b}, 10, "b retires")
                assert healthy(cp) == {a}
                dns.addresses = [a, b]
                await wait_until_async(lambda: not dispatcher.retiring, 10, "b is reinstated")
                assert dispatcher.connections[b] is link_b and not link_b.closing
                assert healthy(cp) == {a, b} and on_b in link_b.handles

                # b leaves again and its stream outlives the drain timeout (1 s): it is cut.
                dns.addresses = [a]
                await wait_until_async(lambda: dispatcher.retiring == {b}, 10, "b retires again")
                # Cut by the drain timeout (the stream's error says so below), not by its end:
                # its 300 tokens take 6 s or more at 20 ms a step.
                await wait_until_async(lambda: b not in dispatcher.connections, 30, "b's link closes")
                assert link_b.closing
                results = await asyncio.gather(*streams, return_exceptions=True)
                cut = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
                done = [r for r in results if isinstance(r, list)]
                assert len(cut) == len(done) == 1, results
                assert cut[0].code() == grpc.StatusCode.UNAVAILABLE
                assert "drain timeout" in (cut[0].details() or "")
                assert done[0][0].completion_tokens == 300
            for dp in dps:
                await wait_idle(dp.address, timeout_s=10)  # the cut stream's blocks came back too
        finally:
            await cp.stop()
            for dp in dps:
                await dp.stop()

    asyncio.run(run())
