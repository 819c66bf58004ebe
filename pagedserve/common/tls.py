"""TLS credentials from PEM files, for both planes' gRPC servers and channels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True)
class ServerTLS:
    """A server certificate and key; with `client_ca_file`, clients must present a
    certificate signed by that CA (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file), _read(self.cert_file)
        assert key is not None and cert is not None
        ca = _read(self.client_ca_file)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    """The CA to verify the server with (None: the system roots), and optionally our own
    certificate and key for mutual TLS."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls: give both the client certificate and its key, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def server_tls(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None = None
) -> ServerTLS | None:
    """ServerTLS from CLI flags (None when TLS is off); raises ValueError on a half-given pair."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise ValueError("tls: a client CA needs the server's own --tls-cert-file and --tls-key-file")
        return None
    if cert_file is None or key_file is None:
        raise ValueError("tls: give both --tls-cert-file and --tls-key-file")
    for path in (cert_file, key_file, client_ca_file):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"tls: no such file {path}")
    return ServerTLS(cert_file, key_file, client_ca_file)
