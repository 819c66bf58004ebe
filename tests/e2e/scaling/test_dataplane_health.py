"""A data plane's gRPC health follows its engine loop: SERVING while the loop runs, NOT_SERVING
for good once it has died (the chart's liveness probe then restarts the pod). Before, a data
plane whose loop thread had died answered SERVING forever while it could run nothing."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.dataplane.server.server import SERVICE_NAME
from tests.e2e.harness import ServerThread, engine_config, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_health_is_not_serving_once_the_engine_loop_has_died(tiny: Path) -> None:
    srv = ServerThread(engine_config(tiny, num_blocks=8, max_model_len=256), tiny)
    try:
        address = srv.dataplane.address
        assert health(address) == health(address, SERVICE_NAME) == SERVING
        loop = srv.dataplane.loop

        def crash() -> None:
            raise RuntimeError("a bug in a step")

        loop._post(crash)  # runs in the loop thread, between steps: the loop dies of it
        wait_until(lambda: not loop.alive, 10, "the engine loop dies")
        assert isinstance(loop.fatal_error, RuntimeError)
        wait_until(lambda: health(address) == NOT_SERVING, 10, "the data plane's health turns NOT_SERVING")
        assert health(address, SERVICE_NAME) == NOT_SERVING
        # The control plane loses it too (the data plane refuses new streams): /health is 503.
        wait_until(lambda: http_status(f"{srv.http_url}/health") == 503, 10, "the control plane sees it")
    finally:
        srv.close()


def test_a_stopped_engine_loop_reports_not_serving_too(tiny: Path) -> None:
    srv = ServerThread(engine_config(tiny, num_blocks=8, max_model_len=256), tiny)
    try:
        address = srv.dataplane.address
        assert health(address) == SERVING
        srv.dataplane.loop.stop()
        wait_until(lambda: health(address) == NOT_SERVING, 10, "health turns NOT_SERVING after stop")
        # A watcher registered after the loop ended hears at once.
        heard: list[bool] = []
        srv.dataplane.loop.on_exit(lambda: heard.append(True))
        assert heard == [True]
    finally:
        srv.close()
