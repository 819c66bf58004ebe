"""The data plane's metrics port (`--metrics-port`): Prometheus `/metrics`, and `/healthz`.

`/healthz` answers 200 while the engine loop runs and 503 once it has ended (stopped, or died
of a fault): the signal gRPC health gives on the data plane's port, in plain HTTP. Kubernetes'
native gRPC probe speaks no TLS, so with TLS on the gRPC port the Helm chart's probes GET
`/healthz` here; `/metrics` would keep answering for a data plane whose loop is dead.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HEALTH_PATH = "/healthz"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds is not worth a line on stderr


def metrics_app(registry: CollectorRegistry, alive: Callable[[], bool]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: `/healthz` from `alive()`, everything else Prometheus' exposition."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics(environ, start_response)
        ok = alive()
        body = b"ok\n" if ok else b"the engine loop has stopped\n"
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry, alive: Callable[[], bool]
) -> WSGIServer:
    """Serve `metrics_app` on `host:port` (0: any free port) from a daemon thread; returns the
    server (`server_port`, `shutdown()`)."""

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, metrics_app(registry, alive), Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
