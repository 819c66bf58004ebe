"""Who may use a data plane: control planes that present the shared token
(`--dataplane-token-file`), checked on every DataPlaneService call. Health and reflection stay
open (probes). Mutual TLS, the other way in, is the server's credentials (server.py)."""

from __future__ import annotations

import grpc

from pagedserve.common.log import get_logger
from pagedserve.common.tls import (
    DATAPLANE_TOKEN_METADATA,
    Continuation,
    deny_like,
    metadata_values,
    token_matches,
)
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

log = get_logger(__name__)

PROTECTED_PREFIX = "/" + dataplane_pb2.DESCRIPTOR.services_by_name["DataPlaneService"].full_name + "/"
UNAUTHENTICATED_MESSAGE = (
    "this data plane requires its shared token: start the control plane with the same --dataplane-token-file"
)


class DataPlaneTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses DataPlaneService calls without exactly one correct token with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        sent = metadata_values(handler_call_details.invocation_metadata, DATAPLANE_TOKEN_METADATA)
        if token_matches(self._token, sent):
            return handler
        log.warning("dataplane_call_refused", method=handler_call_details.method, token_sent=bool(sent))
        return deny_like(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
