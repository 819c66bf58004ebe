"""Security of the gRPC ports, for both planes: TLS credentials from PEM files, the shared
token control planes present to data planes (`--dataplane-token-file`), and the handler that
refuses a call in place of the one it was meant for."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# The metadata key of the data-plane token on the link (a control plane sends it on every call).
DATAPLANE_TOKEN_METADATA = "x-pagedserve-dataplane-token"
MIN_TOKEN_LENGTH = 16


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
    certificate and key for mutual TLS. `server_name`: the name the server's certificate must
    carry, in place of the host dialled (servers found by DNS are dialled by IP address)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls: give both the client certificate and its key, or neither")
        if self.server_name is not None and (
            not self.server_name or any(c.isspace() for c in self.server_name)
        ):
            raise ValueError(f"tls: the server name must be a DNS name, got {self.server_name!r}")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """Channel options the credentials need: the name to verify the certificate against."""
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


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


def read_token_file(path: str) -> str:
    """The shared data-plane token in `path` (surrounding whitespace stripped); ValueError
    naming the file when it is missing, empty or too short to be a secret."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataplane token: no such file {path}")
    token = file.read_text().strip()
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise ValueError(
            f"dataplane token: {path} must hold one token of at least {MIN_TOKEN_LENGTH} characters "
            "without spaces (e.g. the output of `openssl rand -hex 32`)"
        )
    return token


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying `token` (none without one)."""
    return () if token is None else ((DATAPLANE_TOKEN_METADATA, token),)


def token_matches(expected: str, values: Sequence[str]) -> bool:
    """Exactly one token value was sent and it equals `expected` (compared in constant time)."""
    if len(values) != 1:
        return False
    return hmac.compare_digest(
        hashlib.sha256(values[0].encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )


def metadata_values(metadata: Sequence[tuple[str, Any]] | None, key: str) -> list[str]:
    """Every value of `key` in call metadata (a key sent twice has two)."""
    return [str(v) for k, v in metadata or () if k == key]


def deny_like(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with `code`: what a server
    interceptor returns to refuse a call (the request is never handed to the service)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover (makes this an async generator, like the handler it replaces)

    request_streaming = bool(handler.request_streaming)
    if handler.response_streaming:
        make: Callable[..., grpc.RpcMethodHandler] = (
            grpc.stream_stream_rpc_method_handler
            if request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return make(deny_stream, handler.request_deserializer, handler.response_serializer)
    make = grpc.stream_unary_rpc_method_handler if request_streaming else grpc.unary_unary_rpc_method_handler
    return make(deny, handler.request_deserializer, handler.response_serializer)


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
