"""`/live`, the liveness probe: 200 while the control plane can serve, 503 (with the reason)
once it cannot: `serve` gave up on its data plane, a task it cannot work without ended, or
its event loop stalled. Readiness (`/health`) is the data planes' business, not this."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedserve.controlplane.server import Liveness
from tests.clock import FakeClock
from tests.e2e.harness import ServerThread, engine_config


async def _until(condition: Callable[[], bool], turns: int = 100) -> None:
    """Yield to the loop (no time passes) until `condition` holds."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_liveness_reasons(clock: FakeClock) -> None:
    async def run() -> None:
        liveness = Liveness(stall_s=1.0, clock=clock)  # a heartbeat every 0.25 s
        heartbeat = asyncio.create_task(liveness.heartbeat())
        vital = asyncio.create_task(clock.sleep(3600))
        liveness.watch("the vital task", vital)
        await _until(lambda: liveness.live)
        assert liveness.problem() is None
        clock.advance(1.0)  # the loop blocked (nothing ran), but not longer than stall_s
        assert liveness.problem() is None
        clock.advance(0.75)
        assert liveness.problem() == "the event loop was blocked for 2 s"  # 1.75 s, rounded
        await _until(lambda: liveness.live)  # the heartbeat's next beat brings it back
        vital.cancel()
        await asyncio.wait({vital})
        assert liveness.problem() == "the vital task stopped"
        liveness.fail("the data plane kept dying")
        liveness.fail("a later reason does not replace the first")
        assert liveness.problem() == "the data plane kept dying"
        heartbeat.cancel()

    asyncio.run(run())


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny, num_blocks=8, max_model_len=256), tiny)
    yield srv
    srv.close()


def get(url: str) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_live_fails_once_the_process_cannot_serve(server: ServerThread) -> None:
    assert server.controlplane.live()
    assert get(f"{server.http_url}/live")[0] == 200
    server.controlplane.liveness.fail("the data plane died 6 times within 300 s: giving up")
    assert not server.controlplane.live()
    status, body = get(f"{server.http_url}/live")
    assert status == 503 and "giving up" in body["reason"]
