"""TLS to data planes found by DNS: they are dialled by IP address, so the control plane checks
their certificate against `--dataplane-tls-server-name` (gRPC's ssl_target_name_override)
instead. A mutual-TLS link to a data plane whose certificate names only "dataplane.test",
dialled at 127.0.0.1, joins with the flag and never without it; the chart passes the flag
whenever the links use TLS with DNS discovery."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import build_parser
from pagedserve.clients.python import AsyncGenerationClient
from pagedserve.common.tls import ClientTLS, ServerTLS
from pagedserve.controlplane.cli import config_from_args
from pagedserve.controlplane.server import start_control_plane
from tests.e2e.certs import Pki
from tests.e2e.harness import engine_config, start_dataplane

SERVER_NAME = "dataplane.test"


def make_pki(directory: Path, dns_name: str) -> Pki:
    """A CA, a data-plane certificate for `dns_name` only (no IP address) and a client certificate."""
    pytest.importorskip("cryptography", reason="cryptography (a dev dependency) makes the certificates")
    from tests.e2e.certs import make_pki as make

    return make(directory, dns_names=(dns_name,), ip_addresses=())


def controlplane_argv(tiny: Path, address: str, pki: Pki, *extra: str) -> list[str]:
    return [
        "controlplane",
        "--model",
        str(tiny),
        "--dataplane",
        address,
        "--dataplane-tls-ca-file",
        pki.ca,
        "--dataplane-tls-cert-file",
        pki.client_cert,
        "--dataplane-tls-key-file",
        pki.client_key,
        *extra,
    ]


def test_a_data_plane_dialled_by_ip_is_verified_against_the_server_name(tiny: Path, tmp_path: Path) -> None:
    pki = make_pki(tmp_path, SERVER_NAME)

    async def joins(argv: list[str], wait_s: float) -> bool:
        config = config_from_args(build_parser().parse_args(argv))
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
        try:
            if not await cp.dispatcher.wait_ready(wait_s):
                return False
            async with AsyncGenerationClient(f"127.0.0.1:{cp.grpc_port}") as client:
                out = await client.generate([5, 6, 7], max_tokens=3, temperature=0.0)
                assert out[0].completion_tokens == 3
            return True
        finally:
            await cp.stop()

    async def run() -> None:
        tls = ServerTLS(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
        dp = await start_dataplane(engine_config(tiny), tls=tls)
        try:
            assert dp.address.startswith("127.0.0.1:")  # not a name in the certificate
            base = controlplane_argv(tiny, dp.address, pki)
            assert await joins([*base, "--dataplane-tls-server-name", SERVER_NAME], 20.0)
            # Without the name, 127.0.0.1 is checked against a certificate for dataplane.test.
            assert not await joins(base, 2.0)
            # A name the certificate does not carry fails the same way.
            assert not await joins([*base, "--dataplane-tls-server-name", "other.test"], 2.0)
        finally:
            await dp.stop()

    asyncio.run(run())


def test_the_server_name_needs_tls_and_becomes_the_channel_option(tmp_path: Path) -> None:
    argv = ["controlplane", "--dataplane", "127.0.0.1:1", "--dataplane-tls-server-name", SERVER_NAME]
    with pytest.raises(ValueError, match="--dataplane-tls-ca-file"):
        config_from_args(build_parser().parse_args(argv))
    ca = tmp_path / "ca.pem"
    ca.write_text("unused")
    config = config_from_args(build_parser().parse_args([*argv, "--dataplane-tls-ca-file", str(ca)]))
    assert config.dataplane_tls == ClientTLS(str(ca), server_name=SERVER_NAME)
    assert config.dataplane_tls.channel_options() == (("grpc.ssl_target_name_override", SERVER_NAME),)
    assert ClientTLS(str(ca)).channel_options() == ()
    with pytest.raises(ValueError, match="DNS name"):
        ClientTLS(str(ca), server_name="two words")


LINK_TLS = {
    "tls": {
        "dataplane": {
            "enabled": True,
            "serverSecretName": "pagedserve-dataplane-tls",
            "clientSecretName": "pagedserve-controlplane-client-tls",
        }
    }
}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "llm-pagedserve-dataplane.serving.svc.cluster.local"),  # DNS discovery: the Service
        ({"tls": {"dataplane": {"serverName": "dataplanes.example"}}}, "dataplanes.example"),
        ({"controlplane": {"discovery": "static"}}, None),  # static: the names dialled are checked
        ({"tls": {"dataplane": {"enabled": False}}}, None),
    ],
)
def test_the_chart_passes_the_server_name_with_dns_discovery(
    extra: dict[str, Any], expected: str | None
) -> None:
    from tests.deploy.chart import container, merged, objects, one, render

    objs = objects(render(merged(LINK_TLS, extra)))
    args = container(one(objs, "Deployment", "controlplane"), "controlplane")["args"]
    # The chart runs `pagedserve-controlplane ARGS`, the same as `pagedserve controlplane ARGS`.
    parsed = build_parser().parse_args(["controlplane", *args])
    assert parsed.dataplane_tls_server_name == expected
    if expected is not None:
        assert parsed.dataplane_dns.rsplit(":", 1)[0] == "llm-pagedserve-dataplane.serving.svc.cluster.local"
