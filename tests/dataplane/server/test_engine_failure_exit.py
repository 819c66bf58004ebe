"""A data plane whose engine loop dies of a fault no request can be blamed for stops serving
at once and `serve` returns EXIT_ENGINE_FAILED (the process exits non-zero, so `serve` or
Kubernetes restarts it whatever its probes see)."""

from __future__ import annotations

import asyncio

from pagedserve.dataplane.engine.outputs import StepResult
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.server import EXIT_ENGINE_FAILED, bind_server, serve
from tests.dataplane.test_engine_loop import IDENTITY, FakeEngine


class BrokenEngine(FakeEngine):
    """Has work, and every step raises (a kernel fault, a broken invariant)."""

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> StepResult:
        raise RuntimeError("a kernel fault")


def test_serve_returns_non_zero_when_the_engine_loop_dies() -> None:
    async def main() -> int:
        server, port = await bind_server("127.0.0.1:0")
        loop = EngineLoop(BrokenEngine(), IDENTITY)
        # (the timeout is a hang guard only: serve returns as soon as it sees the loop's exit)
        return await asyncio.wait_for(serve(loop, server, port, grace_s=0.1), timeout=60)

    assert asyncio.run(main()) == EXIT_ENGINE_FAILED
