"""`pagedserve controlplane`: a stateless control plane in front of data planes.

`pagedserve-controlplane` (the control-plane distribution's own command, what its image runs)
takes the same flags. Its flags are derived from ControlPlaneConfig (controlplane/src/pagedserve/controlplane/config.py), plus the security
group here, whose files are read into the config's keys and TLS settings. The product shell
(src/pagedserve/cli.py, src/pagedserve/serve.py) mounts these.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pagedserve.common import settings
from pagedserve.common.lifecycle import cli_command
from pagedserve.common.log_format import LoggingConfig
from pagedserve.controlplane.config import ControlPlaneConfig

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


def add_listen_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("listen")
    g.add_argument("--host", default="127.0.0.1", help="address the gRPC and HTTP ports listen on")
    g.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="public gRPC port (0 picks a free one)"
    )
    g.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port: health, metrics, OpenAI API"
    )


def add_security_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("security")
    s.add_argument(
        "--api-key", action="append", default=[], help="require this API key, repeatable (default: none)"
    )
    s.add_argument(
        "--api-key-file",
        default=None,
        help="file of API keys: one per line, as `key` (a tenant of its own) or `tenant: key`, "
        'or JSON {"tenant": ["key", ...]}; a tenant never hits another tenant\'s prefix cache; '
        "lines `tenant weight=W max_concurrency=N tokens_per_minute=T` set a tenant's fair share "
        "and limits (`*` for all; docs/operations.md, Tenants) "
        "(default: none; with neither this nor --api-key, no authentication)",
    )
    s.add_argument(
        "--tls-cert-file",
        default=None,
        help="serve gRPC and HTTP over TLS with this certificate (PEM) (default: none, plaintext)",
    )
    s.add_argument(
        "--tls-key-file", default=None, help="the certificate's private key (PEM) (default: none, plaintext)"
    )
    s.add_argument(
        "--dataplane-tls-ca-file",
        default=None,
        help="connect to data planes over TLS, verified by this CA (default: none, plaintext)",
    )
    s.add_argument(
        "--dataplane-tls-cert-file",
        default=None,
        help="client certificate for mTLS to data planes (default: none, no client certificate)",
    )
    s.add_argument(
        "--dataplane-tls-key-file",
        default=None,
        help="its private key (default: none, no client certificate)",
    )
    s.add_argument(
        "--dataplane-tls-server-name",
        default=None,
        help="the DNS name the data planes' certificates must carry, checked in place of the "
        "address dialled (with --dataplane-dns, data planes are dialled by IP address) "
        "(default: none, the host part of the address dialled)",
    )


def add_controlplane_args(p: argparse.ArgumentParser, *, own_dataplane: bool = False) -> None:
    """Listen, control-plane and security flags. `own_dataplane` for `serve`: it starts the
    data plane itself (no --dataplane flags) and its engine flags name the model."""
    add_listen_args(p)
    skip = {"model", "model_home", "dataplanes", "dataplane_dns"} if own_dataplane else set()
    settings.add_arguments(p, ControlPlaneConfig, title="control plane", skip=skip)
    add_security_args(p)


def ready_line(host: str, grpc_port: int, http_port: int | None, tls: bool) -> str:
    """The line that says the server answers; under TLS it says so, with https:// (both ports
    then speak TLS: a plaintext client gets only a closed socket)."""
    scheme = "https" if tls else "http"
    line = f"pagedserve gRPC on {host}:{grpc_port}  HTTP on {scheme}://{host}:{http_port}"
    return line + "  (TLS: clients need the CA of --tls-cert-file)" if tls else line


def config_from_args(args: argparse.Namespace, **overrides: Any) -> ControlPlaneConfig:
    """ControlPlaneConfig from the flags, with key files and certificates read; `overrides`
    (e.g. the data plane `serve` started) replace fields before validation."""
    from pagedserve.common.tls import ClientTLS, server_tls
    from pagedserve.controlplane.tenancy.auth import load_keys, load_tenant_settings

    dataplane_tls = None
    server_name = getattr(args, "dataplane_tls_server_name", None)
    if args.dataplane_tls_ca_file or args.dataplane_tls_cert_file:
        dataplane_tls = ClientTLS(
            args.dataplane_tls_ca_file,
            args.dataplane_tls_cert_file,
            args.dataplane_tls_key_file,
            server_name=server_name,
        )
    elif server_name is not None:
        raise ValueError("--dataplane-tls-server-name needs TLS to the data planes (--dataplane-tls-ca-file)")
    values = {**vars(args), **overrides}
    values["api_keys"], values["api_key_tenants"] = load_keys(args.api_key, args.api_key_file)
    values["tenant_settings"] = load_tenant_settings(args.api_key_file)
    values["tls"] = server_tls(args.tls_cert_file, args.tls_key_file)
    values["dataplane_tls"] = dataplane_tls
    return settings.from_arguments(ControlPlaneConfig, values)


def add_controlplane_parser(sub: Any) -> None:
    cp = sub.add_parser(
        "controlplane",
        help="run a stateless control plane in front of data planes",
        formatter_class=settings.HelpFormatter,
    )
    add_controlplane_args(cp)
    settings.add_arguments(cp, LoggingConfig, title="logging")
    cp.set_defaults(func=cmd_controlplane)


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve-controlplane`'s parser: the flags of `pagedserve controlplane`."""
    parser = settings.ArgumentParser(
        prog="pagedserve-controlplane", description="run a stateless control plane in front of data planes"
    )
    add_controlplane_args(parser)
    settings.add_arguments(parser, LoggingConfig, title="logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`pagedserve-controlplane`: `pagedserve controlplane` without the product shell (and its
    torch), for an install or image of the control plane alone."""
    from pagedserve.common import env
    from pagedserve.common.log import use_log_format

    args = build_parser().parse_args(argv)
    use_log_format(args.log_format or env.log_format())
    try:
        return cmd_controlplane(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve-controlplane: error: {exc}", file=sys.stderr)
        return 1


@cli_command
def cmd_controlplane(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    # Serve once a data plane has connected (or after 10 s): requests sent right after the
    # address is printed should not meet an empty routing set.
    return asyncio.run(run_controlplane(config, args.host, args.grpc_port, args.http_port, wait_s=10.0))


async def run_controlplane(
    config: ControlPlaneConfig, host: str, grpc_port: int, http_port: int, wait_s: float
) -> int:
    """Start the control plane, announce its ports once a data plane is connected (or after
    `wait_s`), and serve until SIGINT/SIGTERM; returns the exit code (0 after serving, 128 +
    the signal when stopped before announcing)."""
    from pagedserve.common.telemetry import configure_tracing
    from pagedserve.controlplane.server import run_until_signalled, start_control_plane, stop_signals

    configure_tracing("pagedserve-controlplane")
    cp = await start_control_plane(config, host, grpc_port, http_port)
    signals = stop_signals(cp)
    stopped = signals.first
    if wait_s:
        ready = asyncio.ensure_future(cp.dispatcher.wait_ready(wait_s))
        waiters: set[asyncio.Future[Any]] = {ready, stopped}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
    announced = not stopped.done()
    if announced:
        print(ready_line(host, cp.grpc_port, cp.http_port, config.tls is not None), flush=True)
    await run_until_signalled(cp, signals)
    return 0 if announced else 128 + stopped.result()  # 130: Ctrl-C while starting
