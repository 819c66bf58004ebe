"""API keys (same rules on gRPC and HTTP; health and metrics stay open), TLS on the public
ports, and mutual TLS between the planes. Certificates are generated per test run."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.clients.python import GenerationClient
from pagedserve.common.tls import ClientTLS, ServerTLS
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.server import start_control_plane
from pagedserve.controlplane.tenancy.auth import ApiKeys, load_api_keys
from tests.e2e.certs import Pki, make_pki
from tests.e2e.harness import Process, ServerThread, engine_config


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_api_key_parsing_and_checking(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n beta  # rotated 2026-11\nalpha\n")
    assert load_api_keys(["gamma"], f) == ("gamma", "alpha", "beta")
    keys = ApiKeys(["alpha", "beta"])
    assert keys.check_header("Bearer alpha") and keys.check_header("bearer beta")
    for bad in (None, "", "alpha", "Bearer", "Bearer gamma", "Basic alpha"):
        assert not keys.check_header(bad)
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeys([])


@pytest.fixture(scope="module")
def keyed(tiny: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny), tiny, api_keys=("alpha", "beta"))
    yield srv
    srv.close()


def test_grpc_needs_a_key_but_health_does_not(keyed: ServerThread) -> None:
    for key in (None, "wrong"):
        with GenerationClient(keyed.grpc_address, api_key=key, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate([5, 6, 7], max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                client.tokenize("x")
    with GenerationClient(keyed.grpc_address, api_key="beta", timeout=30) as client:
        assert client.generate([5, 6, 7], max_tokens=2)[0].completion_tokens == 2
    with grpc.insecure_channel(keyed.grpc_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_http_needs_a_key_but_health_and_metrics_do_not(keyed: ServerThread) -> None:
    model = keyed.controlplane.dispatcher.config.model
    bad = openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=model, prompt=[5, 6], max_tokens=2)
    assert err.value.status_code == 401
    assert err.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key="alpha", max_retries=0)
    assert good.completions.create(model=model, prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
    for path in ("/health", "/live", "/metrics"):
        with urllib.request.urlopen(f"{keyed.http_url}{path}", timeout=10) as response:
            assert response.status == 200
    with urllib.request.urlopen(f"{keyed.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'pagedserve_request_failure_total{code="UNAUTHENTICATED"}' in text


def test_tls_public_ports_and_mutual_tls_to_the_data_plane(tiny: Path, pki: Pki) -> None:
    srv = ServerThread(
        engine_config(tiny),
        tiny,
        dp_server_tls=ServerTLS(pki.server_cert, pki.server_key, client_ca_file=pki.ca),
        tls=ServerTLS(pki.server_cert, pki.server_key),
        dataplane_tls=ClientTLS(pki.ca, pki.client_cert, pki.client_key),
    )
    try:
        with GenerationClient(srv.grpc_address, tls_ca_file=pki.ca, timeout=30) as client:
            assert client.generate([5, 6, 7], max_tokens=3)[0].completion_tokens == 3
        with GenerationClient(srv.grpc_address, timeout=5) as plain, pytest.raises(grpc.RpcError):
            plain.generate([5, 6, 7], max_tokens=3)
        https = srv.http_url.replace("http://", "https://")
        context = ssl.create_default_context(cafile=pki.ca)
        with urllib.request.urlopen(f"{https}/health", timeout=10, context=context) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{https}/health", timeout=10)  # not trusted without our CA

        # A control plane without a client certificate cannot join the data plane.
        async def outsider() -> bool:
            config = ControlPlaneConfig(
                model=str(tiny), dataplanes=(srv.dataplane.address,), dataplane_tls=ClientTLS(pki.ca)
            )
            cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
            try:
                return await cp.dispatcher.wait_ready(2.0)
            finally:
                await cp.stop()

        assert srv._run(outsider()) is False
    finally:
        srv.close()


def _mismatch_lines(proc: Process) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in proc.stderr().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "tls_handshake_failed"]


def test_a_plaintext_client_on_the_tls_http_port_gets_a_log_line_naming_it(tiny: Path, pki: Pki) -> None:
    """`pagedserve serve` with TLS: a plaintext HTTP request is refused and the server logs one
    line naming the mismatch (a second one at once is rate-limited), then keeps serving TLS."""
    argv = ["serve", "--model", str(tiny), "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
    argv += [
        "--kv-cache-memory",
        "64MiB",
        "--tls-cert-file",
        pki.server_cert,
        "--tls-key-file",
        pki.server_key,
    ]
    proc = Process(argv, "gRPC on ")
    try:
        http_address = proc.line.split("https://", 1)[1].split()[0]
        host, port = http_address.rsplit(":", 1)
        for _ in range(2):
            plain = http.client.HTTPConnection(host, int(port), timeout=10)
            with pytest.raises((http.client.HTTPException, OSError)):
                plain.request("GET", "/health")
                plain.getresponse()
            plain.close()
        deadline = time.monotonic() + 10
        while not _mismatch_lines(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = _mismatch_lines(proc)
        assert len(lines) == 1, lines  # the second request, from the same peer, is rate-limited
        line = lines[0]
        assert line["port"] == "http" and str(line["peer"]).startswith("127.0.0.1:")
        assert line["received"] == "a plaintext HTTP request (GET)"
        assert "the port speaks TLS; the client connected in plaintext" in str(line["hint"])
        assert line["level"] == "warning"

        # Still serving TLS, on both ports.
        context = ssl.create_default_context(cafile=pki.ca)
        with urllib.request.urlopen(
            f"https://{http_address}/health", timeout=10, context=context
        ) as response:
            assert response.status == 200
        body = json.dumps({"model": str(tiny), "prompt": [5, 6, 7], "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"https://{http_address}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2
        with GenerationClient(proc.address, tls_ca_file=pki.ca, timeout=60) as client:
            assert client.generate([5, 6, 7], max_tokens=2)[0].completion_tokens == 2
    finally:
        proc.kill(signal.SIGINT)
