"""API keys for the public endpoints: `Authorization: Bearer <key>` on HTTP, and the same
`authorization` metadata on gRPC. Health probes and /metrics stay open. No torch."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

PROTECTED_GRPC_PREFIX = "/pagedserve.v1.GenerationService/"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None) -> tuple[str, ...]:
    """Keys from flags plus a file (one per line; blank lines and `#` comments ignored)."""
    out = [k.strip() for k in keys if k.strip()]
    if key_file is not None:
        for line in Path(key_file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return tuple(dict.fromkeys(out))


class ApiKeys:
    """Checks bearer tokens in constant time against the SHA-256 of each configured key."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        if not self._digests:
            raise ValueError("api keys: at least one key is needed to enable authentication")

    def check_header(self, value: str | None) -> bool:
        if not value:
            return False
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        # Compare against every key (no early exit) so timing reveals nothing.
        matches = [hmac.compare_digest(digest, d) for d in self._digests]
        return any(matches)


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects GenerationService calls without a valid key with UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys, on_reject: Callable[[], None] | None = None) -> None:
        self.keys = keys
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if not method.startswith(PROTECTED_GRPC_PREFIX):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.check_header(metadata.get("authorization")):
            return await continuation(handler_call_details)
        if self.on_reject is not None:
            self.on_reject()
        handler = await continuation(handler_call_details)
        return _reject_like(handler)


def _reject_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover (makes this an async generator, like the handler it replaces)

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        deny, handler.request_deserializer, handler.response_serializer
    )
