"""The data plane's metrics port answers `/healthz` 200 while the engine loop runs and 503 once
it has ended, stopped or dead of a fault: the chart's probes read it under TLS, where
Kubernetes' gRPC probe cannot reach gRPC health, and `/metrics` keeps answering either way."""

from __future__ import annotations

import contextlib
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.metrics_http import HEALTH_PATH, start_metrics_server
from tests.dataplane.server.test_engine_failure_exit import BrokenEngine
from tests.dataplane.test_engine_loop import IDENTITY, FakeEngine

GUARD_S = 30.0  # a hang guard only: the loop's exit is awaited, not timed


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=GUARD_S) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@contextlib.contextmanager
def serve_metrics(loop: EngineLoop) -> Iterator[int]:
    httpd = start_metrics_server("127.0.0.1", 0, loop.metrics.registry, lambda: loop.alive)
    try:
        yield httpd.server_port
    finally:
        httpd.shutdown()
        httpd.server_close()


def exited(loop: EngineLoop) -> threading.Event:
    done = threading.Event()
    loop.on_exit(done.set)
    return done


@pytest.fixture()
def healthy() -> Iterator[tuple[EngineLoop, int]]:
    loop = EngineLoop(FakeEngine(), IDENTITY)
    loop.start()
    try:
        with serve_metrics(loop) as port:
            yield loop, port
    finally:
        loop.stop()


def test_healthz_is_200_while_the_loop_runs_and_503_once_stopped(healthy: tuple[EngineLoop, int]) -> None:
    loop, port = healthy
    assert get(port, HEALTH_PATH) == (200, b"ok\n")
    status, body = get(port, "/metrics")
    assert status == 200 and b"pagedserve_" in body
    done = exited(loop)
    loop.stop()
    assert done.wait(GUARD_S)
    status, body = get(port, HEALTH_PATH)
    assert status == 503 and b"stopped" in body
    assert get(port, "/metrics")[0] == 200  # why /metrics cannot be the liveness probe


def test_healthz_is_503_once_the_loop_died_of_a_fault() -> None:
    loop = EngineLoop(BrokenEngine(), IDENTITY)
    done = exited(loop)
    with serve_metrics(loop) as port:
        loop.start()  # its first step raises: the loop ends
        assert done.wait(GUARD_S)
        assert loop.fatal_error is not None
        assert get(port, HEALTH_PATH)[0] == 503
    loop.stop()
