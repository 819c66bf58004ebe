"""Assemble and run a control plane: dispatcher, gRPC GenerationService, HTTP port.

The ports are checked before anything else and bound without SO_REUSEPORT: a second control
plane on a taken port fails at once with one line (common/src/pagedserve/common/lifecycle.py).
`Liveness` says whether this process can still serve (the HTTP `/live` probe).

SIGTERM (or SIGINT) stops it gracefully (`ControlPlane.shutdown`): gRPC health turns
NOT_SERVING and `/health` 503 at once (both keep answering), new requests are refused
UNAVAILABLE (retryable), the streams under way get `shutdown_grace_s` to finish. Then those
still open are cut, UNAVAILABLE "shutting down" (an SSE stream's last event is that error, a
gRPC stream ends with that status), the ports close and the process exits: within
`shutdown_grace_s + STOP_MARGIN_S` of the signal, whatever the clients do. A second signal
cuts at once (`pagedserve.common.lifecycle.StopSignals` holds both deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.clock import SYSTEM_CLOCK, Clock
from pagedserve.common.lifecycle import (
    NO_REUSEPORT,
    StopSignals,
    add_port,
    bind_error,
    check_port_free,
)
from pagedserve.common.log import get_logger
from pagedserve.common.models.store import resolve_model_path
from pagedserve.common.reflection import enable_reflection
from pagedserve.common.tls import ServerTLS
from pagedserve.controlplane.config import ControlPlaneConfig, model_names
from pagedserve.controlplane.edge.http_server import HttpServer, create_app
from pagedserve.controlplane.edge.servicer import GenerationServicer, add_generation_service
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.refusals import PUBLIC_SERVER_OPTIONS
from pagedserve.controlplane.responses.store import ResponseStore
from pagedserve.controlplane.routing.discovery import Resolver, resolve_dataplanes
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.tenancy.auth import ApiKeys, GrpcAuthInterceptor
from pagedserve.controlplane.tokenizer import Tokenizer
from pagedserve.protos.pagedserve.v1 import generation_pb2

log = get_logger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_HEALTH_POLL_S = 0.5
_HEARTBEAT_S = 1.0
_FLUSH_S = 0.5
"""After a cut: how long the ports wait for the cut responses to go out (the error event, the
status) before closing the connections still open, e.g. a client that reads nothing."""
_HURRIED_FLUSH_S = 0.2  # the same after a second signal


class Liveness:
    """Whether the process can still serve, for a liveness probe (HTTP `/live`; the app finds
    it as `app.state.liveness`). Not live once something declared the process dead (`fail`,
    e.g. `serve` gave up restarting its data plane), once a task the control plane cannot
    work without has ended, or while the event loop's heartbeat is older than `stall_s` (a
    loop blocked that long; one that never comes back answers no probe at all).

    Readiness is another matter: with no data plane connected `/health` says 503 while `/live`
    stays 200, since restarting this process would not bring a data plane back.
    """

    def __init__(self, stall_s: float = 30.0, clock: Clock = SYSTEM_CLOCK) -> None:
        self.stall_s = stall_s
        self._interval_s = min(_HEARTBEAT_S, stall_s / 4)
        self._clock = clock
        self._failure: str | None = None
        self._beat = clock.monotonic()
        self._vital: list[tuple[str, asyncio.Task[None]]] = []

    def fail(self, reason: str) -> None:
        """Declare the process unable to serve for good."""
        if self._failure is None:
            self._failure = reason
            log.error("not_live", reason=reason)

    def watch(self, name: str, task: asyncio.Task[None]) -> None:
        """`task` runs for the control plane's whole life: its end means the process is broken."""
        self._vital.append((name, task))

    def problem(self) -> str | None:
        """Why the process cannot serve, or None while it can."""
        if self._failure is not None:
            return self._failure
        for name, task in self._vital:
            if task.done():
                return f"{name} stopped"
        stalled = self._clock.monotonic() - self._beat
        if stalled > self.stall_s:
            return f"the event loop was blocked for {stalled:.0f} s"
        return None

    @property
    def live(self) -> bool:
        return self.problem() is None

    async def heartbeat(self) -> None:
        while True:
            self._beat = self._clock.monotonic()
            await self._clock.sleep(self._interval_s)


@dataclass
class ControlPlane:
    """A running control plane (see `start_control_plane`)."""

    dispatcher: Dispatcher
    grpc_server: grpc.aio.Server
    grpc_port: int
    http: HttpServer | None
    _health_task: asyncio.Task[None]
    liveness: Liveness = field(default_factory=Liveness)
    _heartbeat_task: asyncio.Task[None] | None = None
    health: health.aio.HealthServicer | None = None

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    def live(self) -> bool:
        """Whether this process can still serve (see `Liveness`)."""
        return self.liveness.live

    async def shutdown(self, grace_s: float, hurry: asyncio.Future[Any] | None = None) -> bool:
        """Stop gracefully: NOT_SERVING (gRPC health, and `/health` 503) and new requests
        refused UNAVAILABLE at once; the generations under way get up to `grace_s` to finish
        (or until `hurry` completes); those still running then are cut and `stop` follows,
        which takes at most about 2 * _FLUSH_S more. True when none had to be cut."""
        self.dispatcher.stop_accepting()
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        waiting = self.dispatcher.in_progress
        log.info("controlplane_stopping", in_progress=waiting, grace_s=grace_s)
        print(stopping_line(waiting, grace_s, hurry is not None), flush=True)
        finished = asyncio.ensure_future(self.dispatcher.wait_finished(grace_s))
        waiters: set[asyncio.Future[Any]] = {finished} if hurry is None else {finished, hurry}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finished.cancel()
        done = self.dispatcher.in_progress == 0
        hurried = hurry is not None and hurry.done()
        why = "stopped at once by a second signal" if hurried else f"its {grace_s:g} s grace is over"
        if not done:
            log.warning(
                "shutdown_grace_over", cut=self.dispatcher.in_progress, grace_s=grace_s, hurried=hurried
            )
        # Hurried: the process has HURRY_S left in all; the cut responses go out in
        # milliseconds, what waits longer is a client that does not read.
        await self.stop(grace_s=0.0, why=why, flush_s=_HURRIED_FLUSH_S if hurried else _FLUSH_S)
        return done

    async def stop(self, grace_s: float = 2.0, why: str | None = None, flush_s: float = _FLUSH_S) -> None:
        """Close the ports and the data-plane links. Generations under way get `grace_s` to
        finish, then are cut (`Dispatcher.cut`: UNAVAILABLE, the control plane is shutting
        down, `why`); the ports give the cut responses `flush_s` to go out, then close what
        is still open. Never waits on a client: a streaming response the client does not
        read, or a gRPC call it never ends, is closed under it."""
        self._health_task.cancel()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        self.dispatcher.stop_accepting()
        if self.dispatcher.in_progress and (grace_s <= 0 or not await self.dispatcher.wait_finished(grace_s)):
            reason = "" if why is None else f" ({why})"
            message = f"the control plane is shutting down{reason}; retry the request"
            log.warning("streams_cut", cut=self.dispatcher.cut(message), reason=why)
        # Both ports at once, each waiting up to `flush_s` for its cut responses.
        stops = [self.grpc_server.stop(flush_s)]
        if self.http is not None:
            stops.append(self.http.stop(flush_s))
        await asyncio.gather(*stops)
        await self.dispatcher.stop()


def stopping_line(in_progress: int, grace_s: float, can_hurry: bool) -> str:
    """The one line a person at the terminal reads when a stop begins: what it waits for, how
    long at most, and (`can_hurry`: a signal started it) that a second Ctrl-C cuts it short."""
    if in_progress:
        plural = "" if in_progress == 1 else "s"
        line = (
            f"pagedserve: stopping: waiting up to {grace_s:g} s for {in_progress} request{plural} "
            "in progress to finish (new ones are refused)"
        )
    else:
        line = "pagedserve: stopping: no requests in progress"
    return line + "; Ctrl-C again (or a second SIGTERM) stops at once" if can_hurry else line


async def create_server(frontend: Frontend, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """A started gRPC server with GenerationService, health and reflection; returns it and its port."""
    server, port, _ = await _start_grpc(frontend, address)
    return server, port


async def _start_grpc(
    frontend: Frontend, address: str, keys: ApiKeys | None = None, tls: ServerTLS | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    interceptors = []
    if keys is not None:
        reject = lambda: frontend.metrics.failure("UNAUTHENTICATED")  # noqa: E731
        interceptors.append(GrpcAuthInterceptor(keys, on_reject=reject))
    # No call dropped by grpc-core's backlog limits: admission refuses them, with a hint.
    server = grpc.aio.server(interceptors=interceptors, options=[*PUBLIC_SERVER_OPTIONS, NO_REUSEPORT])
    port = add_port(server, address, tls.credentials() if tls else None, flag="--grpc-port")
    add_generation_service(GenerationServicer(frontend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [SERVICE_NAME, health.SERVICE_NAME])
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
    config: ControlPlaneConfig,
    host: str = "127.0.0.1",
    grpc_port: int = 0,
    http_port: int | None = 0,
    resolver: Resolver = resolve_dataplanes,
) -> ControlPlane:
    """Connect to the data planes and serve gRPC (and HTTP unless `http_port` is None).
    A port that is taken raises PortInUseError before anything is loaded. `resolver` looks
    up `config.dataplane_dns` (default: DNS)."""
    check_port_free(host, grpc_port, "--grpc-port")
    if http_port is not None:
        check_port_free(host, http_port, "--http-port")
    tokenizer = Tokenizer(resolve_model_path(config.model, config.model_home))
    keys = ApiKeys(config.api_keys, config.api_key_tenants) if config.api_keys else None
    dispatcher = Dispatcher(config, resolver=resolver)
    names, aliases = model_names(config.model, config.served_model_names)
    frontend = Frontend(
        dispatcher,
        tokenizer,
        config.model,
        served_model_names=names,
        model_aliases=aliases,
        tool_call_parser=config.tool_call_parser,
        request_timeout_s=config.request_timeout_s,
        reasoning_parser=config.reasoning_parser,
    )
    server, port, health_servicer = await _start_grpc(frontend, f"{host}:{grpc_port}", keys, config.tls)
    liveness = Liveness()
    http = None
    if http_port is not None:
        store = ResponseStore(
            config.responses_store_max_entries, config.responses_store_max_bytes, config.responses_store_ttl_s
        )
        app = create_app(frontend, keys, store)
        app.state.liveness = liveness
        try:
            http = HttpServer(
                app,
                host,
                http_port,
                config.tls,
                config.http_header_timeout_s,
                config.http_max_connections_per_client,
                frontend.metrics.http_connections_refused.inc,
            )
        except OSError as exc:
            await server.stop(None)
            raise bind_error(host, http_port, exc, "--http-port") from None
        await http.start()
    await dispatcher.start()
    health_task = asyncio.create_task(_track_health(dispatcher, health_servicer), name="health")
    liveness.watch("the health tracker", health_task)
    heartbeat = asyncio.create_task(liveness.heartbeat(), name="heartbeat")
    liveness.watch("the event-loop heartbeat", heartbeat)
    return ControlPlane(dispatcher, server, port, http, health_task, liveness, heartbeat, health_servicer)


def stop_signals(control_plane: ControlPlane) -> StopSignals:
    """SIGINT/SIGTERM handlers for `control_plane`'s process, bounded by its config's
    `shutdown_grace_s` (see `StopSignals`)."""
    return StopSignals(control_plane.dispatcher.config.shutdown_grace_s)


async def run_until_signalled(control_plane: ControlPlane, signals: StopSignals | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully within the config's
    `shutdown_grace_s`; a second signal ends the grace at once."""
    signals = signals if signals is not None else stop_signals(control_plane)
    await signals.first
    await control_plane.shutdown(signals.grace_s, signals.second)
