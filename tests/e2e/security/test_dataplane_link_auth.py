"""The data plane's internal port: with a shared token (`--dataplane-token-file`) it refuses
every DataPlaneService call without it (health stays open), and off loopback it refuses to
start with neither mTLS nor a token unless told `--allow-insecure-dataplane`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.common.tls import DATAPLANE_TOKEN_METADATA, read_token_file
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.dataplane.config import DataPlaneConfig
from pagedserve.dataplane.server.server import build_engine_loop, create_server
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc
from tests.e2e.harness import REPO, engine_config

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    return f


def test_token_files_are_checked(tmp_path: Path, token_file: Path) -> None:
    assert read_token_file(str(token_file)) == TOKEN
    short = tmp_path / "short"
    short.write_text("secret")
    for path, error in ((short, "at least 16"), (tmp_path / "missing", "no such file")):
        with pytest.raises(ValueError, match=error):
            read_token_file(str(path))
        with pytest.raises(ValueError, match=error):
            ControlPlaneConfig(dataplanes=("127.0.0.1:1",), dataplane_token_file=str(path))
    config = ControlPlaneConfig(dataplanes=("127.0.0.1:1",), dataplane_token_file=str(token_file))
    assert config.dataplane_token == TOKEN


def test_a_data_plane_off_loopback_needs_mtls_or_a_token(token_file: Path) -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        DataPlaneConfig(host=host)
    with pytest.raises(ValueError, match="--dataplane-token-file"):
        DataPlaneConfig(host="0.0.0.0")
    DataPlaneConfig(host="0.0.0.0", dataplane_token_file=str(token_file))
    DataPlaneConfig(host="0.0.0.0", tls_cert_file="c", tls_key_file="k", tls_client_ca_file="ca")
    DataPlaneConfig(host="0.0.0.0", allow_insecure_dataplane=True)

    # From the command line: one line and exit 1, before any model is loaded.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve",
            "dataplane",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--model",
            "none",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("pagedserve: error: ") and "--allow-insecure-dataplane" in proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stdout


def test_the_data_plane_refuses_a_stranger_without_the_token(tiny: Path) -> None:
    async def run() -> None:
        loop = build_engine_loop(engine_config(tiny, num_blocks=8, max_model_len=256), "dp-token")
        server, port = await create_server(loop, "127.0.0.1:0", token=TOKEN)
        address = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = dataplane_pb2_grpc.DataPlaneServiceStub(channel)
                strangers: list[list[tuple[str, str]]] = [
                    [],
                    [(DATAPLANE_TOKEN_METADATA, "wrong-token-wrong-token")],
                    [(DATAPLANE_TOKEN_METADATA, TOKEN), (DATAPLANE_TOKEN_METADATA, TOKEN)],
                    [("authorization", f"Bearer {TOKEN}")],
                ]
                for metadata in strangers:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.GetState(dataplane_pb2.GetStateRequest(), metadata=metadata, timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Drain(dataplane_pb2.DrainRequest(), metadata=metadata, timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    call = stub.Connect(metadata=metadata, timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # Probes stay open; the token opens the service.
                health = health_pb2_grpc.HealthStub(channel)
                status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
                good = [(DATAPLANE_TOKEN_METADATA, TOKEN)]
                state = await stub.GetState(dataplane_pb2.GetStateRequest(), metadata=good, timeout=5)
                assert state.snapshot.info.dataplane_id == "dp-token"
            # A control plane's link with the token joins; one without it never does.
            joined = DataPlaneConnection(address, PrefixIndex(), on_change=lambda: None, token=TOKEN)
            refused = DataPlaneConnection(address, PrefixIndex(), on_change=lambda: None, backoff_s=0.05)
            joined.start()
            refused.start()
            try:
                assert await joined.wait_connected(10.0)
                assert joined.info is not None and joined.info.dataplane_id == "dp-token"
                assert not await refused.wait_connected(1.0)
            finally:
                await joined.close()
                await refused.close()
            assert loop.alive  # strangers never reached the engine
        finally:
            await server.stop(0)
            loop.stop()

    asyncio.run(run())


def test_a_control_plane_with_the_token_file_joins(tiny: Path, token_file: Path) -> None:
    from pagedserve.controlplane.server import start_control_plane

    async def run() -> None:
        loop = build_engine_loop(engine_config(tiny, num_blocks=8, max_model_len=256), "dp-token")
        server, port = await create_server(loop, "127.0.0.1:0", token=TOKEN)
        config = ControlPlaneConfig(
            model=str(tiny), dataplanes=(f"127.0.0.1:{port}",), dataplane_token_file=str(token_file)
        )
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
        try:
            assert await cp.dispatcher.wait_ready(10.0)
        finally:
            await cp.stop()
            await server.stop(0)
            loop.stop()

    asyncio.run(run())
