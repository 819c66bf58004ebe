"""`pagedserve dataplane`: bind the port, load the engine, start its loop thread, serve DataPlaneService.

gRPC health (`grpc.health.v1`, the Kubernetes probes) is SERVING while the engine loop runs and
NOT_SERVING for good once it has ended (a step failed, or the loop was stopped): a data plane
whose loop died answers calls but can run nothing, so its liveness probe must fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.grpc_options import LINK_SERVER_OPTIONS
from pagedserve.common.lifecycle import NO_REUSEPORT, add_port, check_port_free
from pagedserve.common.log import get_logger
from pagedserve.common.reflection import enable_reflection
from pagedserve.common.tls import ServerTLS
from pagedserve.dataplane.config import DataPlaneConfig, EngineConfig
from pagedserve.dataplane.server.auth import DataPlaneTokenInterceptor
from pagedserve.dataplane.server.engine_api import DataPlaneIdentity
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.metrics_http import start_metrics_server
from pagedserve.dataplane.server.openmp import release_openmp_threads
from pagedserve.dataplane.server.servicer import DataPlaneServicer
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

log = get_logger(__name__)
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE (sysexits.h): the engine loop died of an internal error

SERVICE_NAME = dataplane_pb2.DESCRIPTOR.services_by_name["DataPlaneService"].full_name


def build_engine_loop(config: EngineConfig, dataplane_id: str | None = None) -> EngineLoop:
    """Load the model and the engine (KV events on, so control planes can index the cache)."""
    from dataclasses import replace

    from pagedserve.dataplane.engine.llm_engine import LLMEngine

    if config.cache.enable_prefix_caching and not config.cache.enable_kv_events:
        config = replace(config, cache=replace(config.cache, enable_kv_events=True))
    engine = LLMEngine(config)
    identity = DataPlaneIdentity(
        dataplane_id=dataplane_id or f"{socket.gethostname()}-{os.getpid()}",
        model=config.model.model,
        block_size=config.cache.block_size,
        num_blocks=engine.pool.num_blocks,
        max_model_len=engine.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        prefix_hash_seed=config.cache.prefix_hash_seed,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        vocab_size=int(engine.runner.model.config.vocab_size),
    )
    return EngineLoop(engine, identity)


async def bind_server(
    address: str, tls: ServerTLS | None = None, token: str | None = None, flag: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server already listening on `address` (without SO_REUSEPORT: a taken port is an
    error here, before any model loads), not yet serving; returns it and its port. With `tls`
    (and its client CA) control planes must connect over mutual TLS; with `token` they must
    send it. Serve it with `start_server` once the engine is loaded (connections wait until
    then)."""
    interceptors = [DataPlaneTokenInterceptor(token)] if token is not None else []
    server = grpc.aio.server(options=[*LINK_SERVER_OPTIONS, NO_REUSEPORT], interceptors=interceptors)
    port = add_port(server, address, tls.credentials() if tls else None, flag)
    return server, port


async def start_server(server: grpc.aio.Server, engine_loop: EngineLoop) -> None:
    """Serve DataPlaneService (plus health and reflection) for `engine_loop` on a bound server."""
    dataplane_pb2_grpc.add_DataPlaneServiceServicer_to_server(DataPlaneServicer(engine_loop), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [SERVICE_NAME, health.SERVICE_NAME])
    if not engine_loop.alive:
        engine_loop.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    report_engine_health(engine_loop, health_servicer)


_health_updates: set[asyncio.Future[None]] = set()  # (kept referenced until done)


def report_engine_health(engine_loop: EngineLoop, health_servicer: health.aio.HealthServicer) -> None:
    """Turn `health_servicer` NOT_SERVING (every service, for good) when `engine_loop` ends."""
    loop = asyncio.get_running_loop()

    def not_serving() -> None:
        if engine_loop.fatal_error is not None:
            log.error("not_serving", reason=f"the engine loop failed: {engine_loop.fatal_error!r}")
        else:
            log.info("not_serving", reason="the engine loop stopped")
        update = asyncio.ensure_future(health_servicer.enter_graceful_shutdown())
        _health_updates.add(update)
        update.add_done_callback(_health_updates.discard)

    def on_exit() -> None:  # (the loop thread)
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody asks any more
            loop.call_soon_threadsafe(not_serving)

    engine_loop.on_exit(on_exit)


async def create_server(
    engine_loop: EngineLoop,
    address: str = "127.0.0.1:0",
    tls: ServerTLS | None = None,
    token: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server for `engine_loop` (started too) on `address`; returns it and its port."""
    server, port = await bind_server(address, tls, token)
    await start_server(server, engine_loop)
    return server, port


def run(config: DataPlaneConfig, tls: ServerTLS | None = None, token: str | None = None) -> int:
    """`pagedserve dataplane`: bind the ports, then load the model, then serve until SIGINT or
    SIGTERM. The model loads in the main thread with no event loop running, so Ctrl-C during
    the load is a plain KeyboardInterrupt (the command exits 130) and SIGTERM ends the process
    at once."""
    from pagedserve.common.models.store import resolve_model_path

    with asyncio.Runner() as runner:
        server, port = runner.run(bind_server(f"{config.host}:{config.port}", tls, token, flag="--port"))
        try:
            if config.metrics_port:
                check_port_free(config.host, config.metrics_port, "--metrics-port")
            model = config.engine.model
            resolve_model_path(model.model, model.model_home)  # not pulled: say so before importing torch
            print(f"pagedserve dataplane loading {model.model} (port {port} bound)", flush=True)
            engine_loop = build_engine_loop(config.engine, config.dataplane_id)
            # The engine steps in its own thread from here on: end the OpenMP workers the load
            # started in this one (dataplane/src/pagedserve/dataplane/server/openmp.py says why).
            release_openmp_threads()
        except BaseException:
            runner.run(server.stop(None))
            raise
        return runner.run(serve(engine_loop, server, port, config.host, config.metrics_port))


async def serve(
    engine_loop: EngineLoop,
    server: grpc.aio.Server,
    port: int,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
    grace_s: float = 5.0,
) -> int:
    """Serve on a bound `server` until SIGINT/SIGTERM, then stop accepting, end the streams and
    stop the loop; returns 0. If the engine loop dies of a fault no request could be blamed
    for, serving stops at once and this returns EXIT_ENGINE_FAILED: the process exits non-zero,
    so its supervisor (`serve`, Kubernetes) restarts it whatever its probes see."""
    await start_server(server, engine_loop)
    if metrics_port is not None:  # /metrics, and /healthz for the probes under TLS (metrics_http.py)
        registry = engine_loop.metrics.registry
        metrics_http = start_metrics_server(host, metrics_port, registry, lambda: engine_loop.alive)
        print(f"pagedserve dataplane metrics on http://{host}:{metrics_http.server_port}/metrics", flush=True)
    log.info("dataplane_serving", address=f"{host}:{port}", dataplane_id=engine_loop.identity.dataplane_id)
    print(f"pagedserve dataplane listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_loop_exit() -> None:  # (the loop thread)
        if engine_loop.fatal_error is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                loop.call_soon_threadsafe(stop.set)

    engine_loop.on_exit(on_loop_exit)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("dataplane_stopping")
    await server.stop(grace_s)
    engine_loop.stop()
    close = getattr(engine_loop.engine, "close", None)  # the grammar compiler's child, if started
    if close is not None:
        close()
    for task in (waiter, stopper):
        task.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    if engine_loop.fatal_error is not None:
        log.error("dataplane_exiting", reason=f"the engine loop failed: {engine_loop.fatal_error!r}")
        return EXIT_ENGINE_FAILED
    return 0
