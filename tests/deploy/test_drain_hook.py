"""The data planes' preStop hook (helm/pagedserve/files/drain.py) against a gRPC server that
speaks DataPlaneService: it drains and waits for the running requests, reports a timeout,
passes a data plane that is already gone, and checks a TLS certificate by the pod's DNS name
while it dials the loopback address."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedserve.common.tls import DATAPLANE_TOKEN_METADATA
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc
from tests.deploy.chart import load_drain_script


class FakeDataPlane(dataplane_pb2_grpc.DataPlaneServiceServicer):
    """Drain semantics of the real servicer: stop taking work, wait while requests remain."""

    def __init__(self, running: int, token: str | None = None, end_at_once: bool = True) -> None:
        self.running = running
        self.token = token
        self.draining = threading.Event()
        self.ended = threading.Event()  # set: the running requests finish (at once, or when the test says)
        if end_at_once:
            self.ended.set()
        self.requests: list[dataplane_pb2.DrainRequest] = []

    def Connect(self, request_iterator: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    def GetState(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    def Drain(self, request: dataplane_pb2.DrainRequest, context: Any) -> dataplane_pb2.DrainResponse:
        sent = [v for k, v in context.invocation_metadata() if k == DATAPLANE_TOKEN_METADATA]
        if self.token is not None and sent != [self.token]:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this data plane requires its shared token")
        self.requests.append(request)
        self.draining.set()
        while request.wait and self.running and context.is_active():  # (until the caller's deadline)
            if self.ended.wait(0.01):
                self.running = 0
        return dataplane_pb2.DrainResponse(num_remaining=self.running)


def serve(fake: FakeDataPlane, credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dataplane_pb2_grpc.add_DataPlaneServiceServicer_to_server(fake, server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    return server, port


@pytest.fixture
def dataplane() -> Iterator[tuple[FakeDataPlane, int]]:
    fake = FakeDataPlane(running=3, end_at_once=False)
    server, port = serve(fake)
    yield fake, port
    server.stop(None)


def test_drain_waits_until_the_running_requests_finish(dataplane: tuple[FakeDataPlane, int]) -> None:
    fake, port = dataplane
    with futures.ThreadPoolExecutor(1) as pool:
        hook = pool.submit(load_drain_script().main, ["--address", f"127.0.0.1:{port}", "--timeout", "60"])
        assert fake.draining.wait(30)
        assert not hook.done() and fake.running == 3  # it waits while requests run
        fake.ended.set()
        assert hook.result(timeout=30) == 0
    assert [r.wait for r in fake.requests] == [True] and fake.running == 0


def test_drain_reports_requests_left_at_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeDataPlane(running=2, end_at_once=False)
    server, port = serve(fake)
    try:
        assert load_drain_script().main(["--address", f"127.0.0.1:{port}", "--timeout", "0.3"]) == 1
    finally:
        server.stop(None)
    assert "still running after 0.3 s" in capsys.readouterr().err


def test_a_data_plane_that_is_gone_needs_no_drain() -> None:
    server, port = serve(FakeDataPlane(running=0))
    server.stop(None)
    assert load_drain_script().main(["--address", f"127.0.0.1:{port}", "--timeout", "2"]) == 0


def test_drain_sends_the_shared_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = "0123456789abcdef0123456789abcdef"
    fake = FakeDataPlane(running=1, token=token)
    server, port = serve(fake)
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "wrong").write_text("f" * 32)
    base = ["--address", f"127.0.0.1:{port}", "--timeout", "5"]
    try:
        assert load_drain_script().main([*base, "--token-file", str(tmp_path / "wrong")]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err and not fake.requests
        assert load_drain_script().main([*base, "--token-file", str(tmp_path / "token")]) == 0
        assert len(fake.requests) == 1 and fake.running == 0
    finally:
        server.stop(None)


def test_half_given_client_certificate_is_refused() -> None:
    with pytest.raises(SystemExit):
        load_drain_script().parse_args(["--address", "x:1", "--timeout", "1", "--cert-file", "c"])


def _pki(directory: Path, dns_name: str) -> dict[str, Path]:
    """A CA, a server certificate for `dns_name` only (no IP), and a client certificate."""
    from tests.e2e.certs import make_pki

    pki = make_pki(directory, dns_names=(dns_name,), ip_addresses=())
    names = {"ca.crt": pki.ca, "server.crt": pki.server_cert, "server.key": pki.server_key}
    names |= {"client.crt": pki.client_cert, "client.key": pki.client_key}
    return {name: Path(path) for name, path in names.items()}


def test_mutual_tls_checks_the_pods_dns_name_on_the_loopback_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("cryptography", reason="cryptography (a dev dependency) makes the certificates")
    pki = _pki(tmp_path, "*.llm-pagedserve-dataplane.serving.svc.cluster.local")
    credentials = grpc.ssl_server_credentials(
        [(pki["server.key"].read_bytes(), pki["server.crt"].read_bytes())],
        root_certificates=pki["ca.crt"].read_bytes(),
        require_client_auth=True,
    )
    fake = FakeDataPlane(running=1)
    server, port = serve(fake, credentials)
    monkeypatch.setenv("POD_NAME", "llm-pagedserve-dataplane-0")
    tls = [
        "--ca-file",
        str(pki["ca.crt"]),
        "--cert-file",
        str(pki["client.crt"]),
        "--key-file",
        str(pki["client.key"]),
    ]
    base = ["--address", f"127.0.0.1:{port}", "--timeout", "5", *tls]
    drain = load_drain_script()
    try:
        name = "$POD_NAME.llm-pagedserve-dataplane.serving.svc.cluster.local"
        assert drain.main([*base, "--server-name", name]) == 0
        assert fake.requests and fake.running == 0
        # Without the name the certificate (DNS names only) does not match 127.0.0.1.
        fake.requests.clear()
        assert drain.main(base) == 1
        assert not fake.requests
    finally:
        server.stop(None)
