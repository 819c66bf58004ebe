"""The control plane's HTTP port: health probes and the OpenAI-compatible API (and /metrics).

uvicorn runs inside the control plane's own event loop (beside the grpc.aio server), on a
socket bound before start so an ephemeral port (0) is known to the caller. A request body is
at most MAX_BODY_BYTES (4 MiB): a larger one is refused with 413, in OpenAI's error JSON,
before any of it reaches a route, and none of it is kept (`BodyLimit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.common.log import get_logger
from pagedserve.common.tls import ServerTLS
from pagedserve.controlplane.anthropic.routes import AnthropicRoutes
from pagedserve.controlplane.edge.http_client_cap import CappedProtocol, ClientConnections
from pagedserve.controlplane.edge.tls_mismatch import MismatchLog, TLSListener
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.openai.embeddings import EmbeddingRoutes
from pagedserve.controlplane.openai.errors import error_response, install_error_handlers, openai_error
from pagedserve.controlplane.openai.routes import OpenAIRoutes
from pagedserve.controlplane.responses.routes import ResponsesRoutes
from pagedserve.controlplane.responses.store import ResponseStore
from pagedserve.controlplane.routing.dispatcher import Dispatcher
from pagedserve.controlplane.tenancy.auth import (
    ApiKeys,
    authenticated_as,
    http_credentials,
    http_path_needs_key,
    refusal_message,
)

MAX_BODY_BYTES = 4 << 20
"""The largest request body the HTTP API reads (4 MiB); larger ones get 413."""
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0
"""How much of a refused body is still read (and dropped) so its client gets the 413."""
_FORCED_STOP_S = 0.5  # after closing the connections: how long uvicorn may take to return

log = get_logger(__name__)


class BodyLimit:
    """ASGI middleware: refuses a request body over `max_bytes` with 413 (OpenAI error JSON).

    The body is read (up to the limit) before the app runs and then replayed to it, so a route
    never sees part of an oversize body; after the body, `receive` is the server's own (a later
    disconnect still reaches the app). A refused body is never kept: what the client still
    sends of it is read and dropped first, up to `drain_bytes` and `drain_s` (nginx's
    "lingering close"), so that a client that writes its whole body before reading gets the
    413 instead of a reset connection. A declared Content-Length beyond that is refused at once.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        drain_bytes: int = DRAIN_BYTES,
        drain_s: float = DRAIN_S,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes
        self.drain_s = drain_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            if declared.isdigit() and int(declared) <= self.drain_bytes:
                await self._drain(receive)
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the end
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                if message.get("more_body", False):
                    await self._drain(receive, size)
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _drain(self, receive: Receive, read: int = 0) -> None:
        """Read and drop the rest of a refused body, within the drain bounds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_s):
                while read <= self.drain_bytes:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        return
                    read += len(message.get("body", b""))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = openai_error(
            413,
            f"the request body is larger than {self.max_bytes} bytes ({self.max_bytes >> 20} MiB)",
            path=scope.get("path", ""),
        )
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class StartupWait:
    """Start-up: a POST under /v1/ (a generation) that arrives before any data plane has served
    waits for one (`Dispatcher.wait_for_startup`) before it is read and validated, since
    validation needs what the data planes report (the context length). Plain ASGI, so that
    streamed responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, dispatcher: Dispatcher) -> None:
        self.app = app
        self.dispatcher = dispatcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            await self.dispatcher.wait_for_startup()
        await self.app(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def create_app(
    frontend: Frontend, api_keys: ApiKeys | None = None, responses_store: ResponseStore | None = None
) -> FastAPI:
    """Health and liveness probes, /metrics, and the OpenAI-compatible API (embeddings too), Anthropic's
    Messages API and the Responses API (with API keys, everything but the probes and /metrics
    is behind them: `auth.http_path_needs_key`). Without `responses_store` the Responses API
    stores nothing."""
    dispatcher, model_name = frontend.dispatcher, frontend.model_name
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
    install_error_handlers(app, frontend)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(StartupWait, dispatcher=dispatcher)  # (inside the key check, added below)

    if api_keys is not None:

        @app.middleware("http")
        async def require_api_key(request: Request, call_next: Any) -> Any:
            """Every path but the probes and /metrics needs exactly one valid key (a Bearer
            authorization header, or Anthropic's x-api-key header); the request then runs as
            the key's tenant (its cache salt is namespaced by it)."""
            if not http_path_needs_key(request.url.path):
                return await call_next(request)
            values = http_credentials(
                request.headers.getlist("authorization"), request.headers.getlist("x-api-key")
            )
            tenant = api_keys.authenticate(values)
            if tenant is None:
                error = ServiceError("UNAUTHENTICATED", refusal_message(values))
                frontend.record_failure(error)
                response = error_response(error, path=request.url.path)
                response.headers["www-authenticate"] = "Bearer"
                return response
            with authenticated_as(tenant):  # (call_next's task starts inside: it inherits it)
                return await call_next(request)

    chat = OpenAIRoutes(frontend)
    app.include_router(chat.router)
    app.include_router(EmbeddingRoutes(frontend).router)
    app.include_router(AnthropicRoutes(chat).router)
    store = responses_store if responses_store is not None else ResponseStore(0, 1, 1.0)
    app.include_router(ResponsesRoutes(chat, store).router)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one data plane is connected, else 503 (a readiness probe)."""
        links = dispatcher.connections.values()
        body = {
            "status": "ok" if dispatcher.healthy else "unavailable",
            "model": model_name,
            "dataplanes": {c.address: ("serving" if c.healthy else "down") for c in links},
        }
        return JSONResponse(body, status_code=200 if dispatcher.healthy else 503)

    @app.get("/live")
    async def live(request: Request) -> JSONResponse:
        """200 while the process can serve, else 503 with the reason (a liveness probe). What
        can fail it is `app.state.liveness` (pagedserve.controlplane.server's `Liveness`), when set."""
        liveness = getattr(request.app.state, "liveness", None)
        problem = liveness.problem() if liveness is not None else None
        if problem is not None:
            return JSONResponse({"status": "not live", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    return app


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's own handlers stop everything, uvicorn included


class HttpServer:
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: ServerTLS | None,
        header_timeout_s: float,
        max_connections_per_client: int = 0,
        on_connection_refused: Callable[[], None] | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if tls is None:
            self._socket = socket.socket(family, socket.SOCK_STREAM)
        else:  # a plaintext client gets a log line naming the mismatch (pagedserve.controlplane.edge.tls_mismatch)
            listener = TLSListener(family, socket.SOCK_STREAM)
            listener.mismatch = MismatchLog("http")
            self._socket = listener
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        ssl: dict[str, Any] = (
            {} if tls is None else {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        )
        # Open connections per client address (http_client_cap.py), shared by every connection.
        self.clients = ClientConnections(max_connections_per_client, on_connection_refused)
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            http=CappedProtocol.configured(header_timeout_s, self.clients),
            **ssl,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http-server")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop serving: no new connections, idle ones closed at once. A response under way
        gets `timeout_s` to end (None: as long as it takes), then its connection is closed
        under it, as if its client had gone: uvicorn alone would wait for every open response
        (a stream its client keeps reading, or one it never reads) without a limit."""
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)
            if not self._task.done():
                self._close_connections()
                # The app sees the disconnect (StreamingResponse stops, the request is
                # aborted); uvicorn no longer waits for anything. Cancel as a last resort.
                await asyncio.wait({self._task}, timeout=_FORCED_STOP_S)
                if not self._task.done():
                    self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()

    def _close_connections(self) -> None:
        self._server.force_exit = True  # uvicorn's own "quit now": it stops waiting for tasks
        connections = list(self._server.server_state.connections)
        if connections:
            log.warning("http_connections_closed", open=len(connections))
        for connection in connections:
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()  # no flush: a client that does not read holds no buffer open
