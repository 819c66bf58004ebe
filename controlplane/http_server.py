"""The control plane's HTTP port: health probes and the OpenAI-compatible API (and /metrics).

uvicorn runs inside the control plane's own event loop (beside the grpc.aio server), on a
socket bound before start so an ephemeral port (0) is known to the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from controlplane.errors import ServiceError
from controlplane.frontend import Frontend
from controlplane.openai.routes import OpenAIRoutes, error_response, install_error_handlers
from pagedserve.common.tls import ServerTLS


def create_app(frontend: Frontend, api_keys: ApiKeys | None = None) -> FastAPI:
    """Health and liveness probes, /metrics, and the OpenAI-compatible API (behind the API
    keys when there are any)."""
    dispatcher, model_name = frontend.dispatcher, frontend.model_name
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
    install_error_handlers(app, frontend)

    if api_keys is not None:

        @app.middleware("http")
        async def require_api_key(request: Request, call_next: Any) -> Any:
            if request.url.path.startswith("/v1/") and not api_keys.check_header(
                request.headers.get("authorization")
            ):
                error = ServiceError("UNAUTHENTICATED", UNAUTHENTICATED_MESSAGE)
                frontend.record_failure(error)
                response = error_response(error)
                response.headers["www-authenticate"] = "Bearer"
                return response
            return await call_next(request)

    app.include_router(OpenAIRoutes(frontend).router)

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
    async def live() -> dict[str, str]:
        """200 as long as the process serves HTTP (a liveness probe)."""
        return {"status": "ok"}

    return app


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's own handlers stop everything, uvicorn included


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, tls: ServerTLS | None = None) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port: int = self._socket.getsockname()[1]
        ssl: dict[str, Any] = (
            {} if tls is None else {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
        )
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **ssl)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http-server")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
