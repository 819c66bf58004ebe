"""Deadlines into the scheduler, end to end on a tiny model: the data plane drops a request at
its deadline wherever it is (waiting, running, preempted), frees its blocks, counts it, and the
client gets DEADLINE_EXCEEDED (gRPC) or 504 (HTTP) after the tokens generated so far.

The deadline here is the server's `--request-timeout` and the HTTP body's `timeout`, which
only the server enforces: a client-side gRPC deadline would end the call on the client's own
clock, and the control plane's abort could then race the data plane's drop.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import grpc

from pagedserve.clients.python import AsyncGenerationClient, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.server import start_control_plane
from pagedserve.dataplane.server.engine_loop import EngineLoop
from tests.e2e.hardening.tiny_served import Http
from tests.e2e.harness import engine_config, get_state, start_dataplane, wait_idle

STREAMS = 16
DEADLINE_S = 2.0
# Generous: "the deadline plus one step" on a loaded 2-core machine, where a step of 16
# sequences (a prefill after preemption included) can take a good part of a second.
LATE_S = 8.0
LONG = dict(max_tokens=900, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def metric(loop: EngineLoop, name: str, labels: dict[str, str] | None = None) -> float:
    return loop.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def deadline_drops(loop: EngineLoop) -> dict[str, float]:
    states = ("compiling", "waiting", "running", "swapped")
    name = "pagedserve_deadline_exceeded_requests_total"
    return {s: v for s in states if (v := metric(loop, name, {"state": s}))}


def test_streams_past_their_deadline_on_a_saturated_data_plane_end_and_free_every_block(tiny: Path) -> None:
    async def run() -> None:
        # 64 blocks of 16 tokens: far less than 16 streams of 900 tokens need, so the data
        # plane is saturated: requests wait for blocks and running ones are preempted.
        dp = await start_dataplane(engine_config(tiny, num_blocks=64))
        config = ControlPlaneConfig(
            model=str(tiny), dataplanes=(dp.address,), request_timeout_s=DEADLINE_S, decode_reserve_blocks=0
        )
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
        assert await cp.dispatcher.wait_ready(10.0)
        try:
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}", retry=NO_RETRY) as client:

                async def stream(i: int) -> tuple[int, grpc.StatusCode | None, float]:
                    started = time.monotonic()
                    tokens = 0
                    try:
                        async for item in client.generate_stream(prompt(i, 24), **LONG):
                            if isinstance(item, StreamChunk):
                                tokens += len(item.token_ids)
                    except grpc.aio.AioRpcError as exc:
                        return tokens, exc.code(), time.monotonic() - started
                    return tokens, None, time.monotonic() - started

                results = await asyncio.gather(*(stream(i) for i in range(STREAMS)))
            # Right after the last error: the drops freed every block, nothing runs or waits.
            state = await get_state(dp.address)
            stats = state.snapshot.stats
            assert list(state.requests) == []
            assert stats.free_blocks == stats.total_blocks and stats.num_running == stats.num_waiting == 0
            assert stats.host_free_blocks == stats.host_total_blocks

            # A stream that runs alone early can finish its 900 tokens within the deadline on a
            # fast step (about 1 ms on the tiny model): it ends OK, complete, before the deadline.
            # Every other one ends DEADLINE_EXCEEDED, by the deadline plus a step.
            expired = [r for r in results if r[1] is not None]
            for tokens, code, elapsed in results:
                if code is None:
                    assert tokens == LONG["max_tokens"] and elapsed < DEADLINE_S
                else:
                    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert DEADLINE_S - 0.05 <= elapsed <= DEADLINE_S + LATE_S
            assert len(expired) >= STREAMS - 2
            streamed = sum(tokens for tokens, _, _ in results)
            assert streamed > 0

            # The data plane dropped every expired one itself, and counted them.
            drops = deadline_drops(dp.loop)
            assert sum(drops.values()) == len(expired), drops
            assert stats.num_aborted_requests == len(expired)
            assert stats.num_preemptions > 0  # it was saturated
            # Every token generated reached its client before the error, and none is generated
            # for them any more: the engine holds no request, and a later state (answered
            # between steps) counts no further token.
            generated = metric(dp.loop, "pagedserve_generation_tokens_total")
            assert generated == streamed
            assert not dp.loop.engine.has_unfinished_requests()
            assert list((await get_state(dp.address)).requests) == []
            assert metric(dp.loop, "pagedserve_generation_tokens_total") == generated
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())


def test_http_timeout_ends_a_stream_after_its_tokens_and_a_plain_call_with_504(tiny: Path) -> None:
    async def run() -> None:
        dp = await start_dataplane(engine_config(tiny))
        config = ControlPlaneConfig(model=str(tiny), dataplanes=(dp.address,), request_timeout_s=600.0)
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=0)
        assert await cp.dispatcher.wait_ready(10.0)
        body = {"prompt": prompt(1, 12), "timeout": 1.0, **LONG}
        try:
            http = Http(f"http://127.0.0.1:{cp.http_port}")
            sse, plain = await asyncio.gather(
                asyncio.to_thread(http.post, "/v1/completions", {**body, "stream": True}),
                asyncio.to_thread(http.post, "/v1/completions", body),
            )
            assert sse.status == 200
            lines = [line.removeprefix("data: ") for line in sse.text.splitlines() if line]
            assert plain.status == 504
            error = plain.json()["error"]
            assert error["code"] == "deadline_exceeded" and error["param"] == "timeout"
            assert error["message"].startswith("timeout of 1 s: the request's deadline passed while it was")

            assert lines[-1] == "[DONE]"
            error = json.loads(lines[-2])["error"]
            assert error["code"] == "deadline_exceeded" and error["param"] == "timeout"
            chunks = [json.loads(line) for line in lines[:-2]]
            assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)

            await wait_idle(dp.address, timeout_s=5)
            assert sum(deadline_drops(dp.loop).values()) == 2
        finally:
            await cp.stop()
            await dp.stop()

    asyncio.run(run())
