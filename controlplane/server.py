"""Assemble and run a control plane: dispatcher, gRPC GenerationService, HTTP port."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.auth import ApiKeys, GrpcAuthInterceptor
from controlplane.config import ControlPlaneConfig
from controlplane.dispatcher import Dispatcher
from controlplane.frontend import Frontend
from controlplane.http_server import HttpServer, create_app
from controlplane.servicer import GenerationServicer
from controlplane.tokenizer import Tokenizer
from pagedserve.common.log import get_logger
from pagedserve.common.models.store import resolve_model_path
from pagedserve.common.reflection import enable_reflection
from pagedserve.common.tls import ServerTLS
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_HEALTH_POLL_S = 0.5


@dataclass
class ControlPlane:
    """A running control plane (see `start_control_plane`)."""

    dispatcher: Dispatcher
    grpc_server: grpc.aio.Server
    grpc_port: int
    http: HttpServer | None
    _health_task: asyncio.Task[None]

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace_s: float = 2.0) -> None:
        self._health_task.cancel()
        await self.grpc_server.stop(grace_s)
        if self.http is not None:
            await self.http.stop()
        await self.dispatcher.stop()


async def create_server(frontend: Frontend, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """A started gRPC server with GenerationService, health and reflection; returns it and its port."""
    server, port, _ = await _start_grpc(frontend, address)
    return server, port


async def _start_grpc(
    frontend: Frontend, address: str, api_keys: tuple[str, ...] = (), tls: ServerTLS | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    interceptors = []
    if api_keys:
        reject = lambda: frontend.metrics.failure("UNAUTHENTICATED")  # noqa: E731
        interceptors.append(GrpcAuthInterceptor(ApiKeys(api_keys), on_reject=reject))
    server = grpc.aio.server(interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(frontend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [SERVICE_NAME, health.SERVICE_NAME])
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the control plane to {address}")
    await server.start()
    return server, port, health_servicer


async def _track_health(dispatcher: Dispatcher, health_servicer: health.aio.HealthServicer) -> None:
    """SERVING while some data plane is connected: load balancers route around us otherwise."""
    last = None
    while True:
        dispatcher.changed.clear()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if dispatcher.healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if status != last:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            last = status
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(dispatcher.changed.wait(), _HEALTH_POLL_S)


async def start_control_plane(
    config: ControlPlaneConfig, host: str = "127.0.0.1", grpc_port: int = 0, http_port: int | None = 0
) -> ControlPlane:
    """Connect to the data planes and serve gRPC (and HTTP unless `http_port` is None)."""
    tokenizer = Tokenizer(resolve_model_path(config.model, config.model_home))
    dispatcher = Dispatcher(config)
    await dispatcher.start()
    frontend = Frontend(dispatcher, tokenizer, config.model, served_model_names=config.served_model_names)
    server, port, health_servicer = await _start_grpc(
        frontend, f"{host}:{grpc_port}", config.api_keys, config.tls
    )
    health_task = asyncio.create_task(_track_health(dispatcher, health_servicer))
    http = None
    if http_port is not None:
        http = HttpServer(
            create_app(frontend, ApiKeys(config.api_keys) if config.api_keys else None),
            host,
            http_port,
            config.tls,
        )
        await http.start()
    return ControlPlane(dispatcher, server, port, http, health_task)


async def run_until_signalled(control_plane: ControlPlane) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("controlplane_stopping")
    await control_plane.stop()
