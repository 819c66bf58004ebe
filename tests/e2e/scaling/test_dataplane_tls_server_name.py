"""TLS to data planes found by DNS: they are dialled by IP address, so the control plane checks
their certificate against `--dataplane-tls-server-name` (gRPC's ssl_target_name_override)
instead. A mutual-TLS link to a data plane whose certificate names only "dataplane.test",
dialled at 127.0.0.1, joins with the flag and never without it; the chart passes the flag
whenever the links use TLS with DNS discovery."""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clients.python import AsyncGenerationClient
from controlplane.cli import config_from_args
from controlplane.server import start_control_plane
from pagedserve.cli import build_parser
from pagedserve.common.tls import ClientTLS, ServerTLS
from tests.e2e.harness import engine_config, start_dataplane
from tests.tiny_models import make_tiny_model

SERVER_NAME = "dataplane.test"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_pki(directory: Path, dns_name: str) -> Pki:
    """A CA, a data-plane certificate for `dns_name` only (no IP address) and a client
    certificate, as PEM files."""
    pytest.importorskip("cryptography", reason="cryptography (a dev dependency) makes the certificates")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: Any, issuer_key: Any, san: str | None, ca: bool) -> Any:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer.subject if issuer is not None else name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def key_pem(key: Any) -> bytes:
        return bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("scaling test CA", ca_key, None, ca_key, None, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = cert(dns_name, server_key, ca, ca_key, dns_name, ca=False)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = cert("control plane", client_key, ca, ca_key, None, ca=False)
    files = {
        "ca.pem": ca.public_bytes(serialization.Encoding.PEM),
        "server.pem": server.public_bytes(serialization.Encoding.PEM),
        "server.key": key_pem(server_key),
        "client.pem": client.public_bytes(serialization.Encoding.PEM),
        "client.key": key_pem(client_key),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    d = directory
    return Pki(*(str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))


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
    parsed = build_parser().parse_args(args)
    assert parsed.dataplane_tls_server_name == expected
    if expected is not None:
        assert parsed.dataplane_dns.rsplit(":", 1)[0] == "llm-pagedserve-dataplane.serving.svc.cluster.local"
