"""`pagedserve dataplane`: the data-plane process (engine + DataPlaneService)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

DEFAULT_PORT = 50052


def add_dataplane_parser(sub: Any) -> None:
    from dataplane.cli import add_engine_args

    p = sub.add_parser(
        "dataplane", help="run a data plane: the KV block pool, scheduler and model, over gRPC"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0 picks a free one)")
    p.add_argument("--dataplane-id", default=None, help="name reported to control planes (default host-pid)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0: any)"
    )
    p.add_argument("--tls-cert-file", default=None, help="serve gRPC over TLS with this certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="the certificate's private key (PEM)")
    p.add_argument(
        "--tls-client-ca-file",
        default=None,
        help="require control planes to present a cert from this CA (mTLS)",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_dataplane)


def cmd_dataplane(args: argparse.Namespace) -> int:
    from dataplane.cli import engine_config_from_args
    from dataplane.server.server import build_engine_loop, serve
    from dataplane.telemetry import configure_tracing

    configure_tracing("pagedserve-dataplane")
    from dataplane.server.tls import server_tls

    tls = server_tls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    engine_loop = build_engine_loop(engine_config_from_args(args), args.model_home, args.dataplane_id)
    asyncio.run(serve(engine_loop, f"{args.host}:{args.port}", metrics_port=args.metrics_port, tls=tls))
    return 0
