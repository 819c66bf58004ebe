"""Throwaway PKI for the TLS tests: a CA, a server certificate (for 127.0.0.1/localhost unless
told other names) and a client certificate, all written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    san: list[x509.GeneralName] | None,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(
    directory: Path,
    dns_names: tuple[str, ...] = ("localhost",),
    ip_addresses: tuple[str, ...] = ("127.0.0.1",),
) -> Pki:
    """The server certificate names `dns_names` and `ip_addresses` (a data plane dialled by IP
    but verified by its DNS name: `dns_names=("dataplane.test",), ip_addresses=()`)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("pagedserve test CA", ca_key, None, ca_key, None, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    san += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    server = _cert(dns_names[0], server_key, ca, ca_key, san, ca=False)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("pagedserve control plane", client_key, ca, ca_key, None, ca=False)
    files = {
        "ca.pem": ca.public_bytes(serialization.Encoding.PEM),
        "server.pem": server.public_bytes(serialization.Encoding.PEM),
        "server.key": _key_pem(server_key),
        "client.pem": client.public_bytes(serialization.Encoding.PEM),
        "client.key": _key_pem(client_key),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    d = str(directory)
    return Pki(f"{d}/ca.pem", f"{d}/server.pem", f"{d}/server.key", f"{d}/client.pem", f"{d}/client.key")
