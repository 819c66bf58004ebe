"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1` (current
grpcurl, Postman) and `grpc.reflection.v1alpha` (older tools).

grpcio-reflection ships only the v1alpha servicer. The v1 service is the same protocol renamed:
its request and response messages have the same fields and numbers, so the v1alpha servicer
answers v1 calls unchanged when registered under the v1 method name.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """List `service_names` plus both reflection services on `server`, over v1 and v1alpha."""
    names = [*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
