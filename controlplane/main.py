"""`pagedserve controlplane` and `pagedserve serve` (a control plane plus a data-plane child)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from dataplane.config import DEFAULT_MODEL


def _add_controlplane_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--host", default="127.0.0.1", help="address the gRPC and HTTP ports listen on")
    g.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port (0 picks a free one)")
    g.add_argument("--http-port", type=int, default=8000, help="HTTP port: health, metrics, OpenAI API")
    g.add_argument(
        "--served-model-name", nargs="+", default=None, help="model names clients may use (first: reported)"
    )
    g.add_argument("--max-queue-len", type=int, default=1024, help="requests that may wait for KV budget")
    g.add_argument(
        "--queue-timeout", type=float, default=60.0, help="seconds a request may wait for KV budget"
    )
    g.add_argument(
        "--decode-reserve-blocks", type=int, default=1, help="blocks reserved per sample beyond the prompt"
    )
    g.add_argument("--routing-prefix-weight", type=float, default=1.0)
    g.add_argument("--routing-usage-weight", type=float, default=0.5)
    g.add_argument("--routing-load-weight", type=float, default=0.5)
    s = p.add_argument_group("security")
    s.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    s.add_argument("--api-key-file", default=None, help="file of API keys, one per line")
    s.add_argument(
        "--tls-cert-file", default=None, help="serve gRPC and HTTP over TLS with this certificate (PEM)"
    )
    s.add_argument("--tls-key-file", default=None, help="the certificate's private key (PEM)")
    s.add_argument(
        "--dataplane-tls-ca-file", default=None, help="connect to data planes over TLS, verified by this CA"
    )
    s.add_argument(
        "--dataplane-tls-cert-file", default=None, help="client certificate for mTLS to data planes"
    )
    s.add_argument("--dataplane-tls-key-file", default=None, help="its private key")


def _config(args: argparse.Namespace, dataplanes: tuple[str, ...], dns: str | None = None) -> Any:
    from controlplane.auth import load_api_keys
    from controlplane.config import ControlPlaneConfig, RoutingWeights
    from dataplane.server.tls import ClientTLS, server_tls

    dataplane_tls = None
    if args.dataplane_tls_ca_file or args.dataplane_tls_cert_file:
        dataplane_tls = ClientTLS(
            args.dataplane_tls_ca_file, args.dataplane_tls_cert_file, args.dataplane_tls_key_file
        )

    return ControlPlaneConfig(
        model=args.model,
        dataplanes=dataplanes,
        dataplane_dns=dns,
        max_queue_len=args.max_queue_len,
        queue_timeout_s=args.queue_timeout,
        decode_reserve_blocks=args.decode_reserve_blocks,
        routing=RoutingWeights(
            args.routing_prefix_weight, args.routing_usage_weight, args.routing_load_weight
        ),
        model_home=args.model_home,
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=load_api_keys(args.api_key, args.api_key_file),
        tls=server_tls(args.tls_cert_file, args.tls_key_file),
        dataplane_tls=dataplane_tls,
    )


def add_controlplane_parsers(sub: Any) -> None:
    from dataplane.cli import add_engine_args

    cp = sub.add_parser("controlplane", help="run a stateless control plane in front of data planes")
    cp.add_argument("--model", default=DEFAULT_MODEL, help="model name or folder (for its tokenizer)")
    cp.add_argument("--model-home", default=None, help="model store folder")
    cp.add_argument(
        "--dataplane", action="append", default=[], metavar="HOST:PORT", help="a data plane (repeatable)"
    )
    cp.add_argument("--dataplane-dns", default=None, metavar="NAME:PORT", help="discover data planes by DNS")
    _add_controlplane_args(cp)
    cp.set_defaults(func=cmd_controlplane)

    serve = sub.add_parser(
        "serve", help="serve the model: one control plane plus one data plane (child process)"
    )
    serve.add_argument("--dataplane-port", type=int, default=0, help="the data plane's internal gRPC port")
    _add_controlplane_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve, _parser=serve)


def cmd_controlplane(args: argparse.Namespace) -> int:
    config = _config(args, tuple(args.dataplane), args.dataplane_dns)
    # Serve once a data plane has connected (or after 10 s): requests sent right after the
    # address is printed should not meet an empty routing set.
    asyncio.run(_run_controlplane(config, args, wait_s=10.0))
    return 0


async def _run_controlplane(config: Any, args: argparse.Namespace, wait_s: float) -> None:
    from controlplane.server import run_until_signalled, start_control_plane
    from dataplane.telemetry import configure_tracing

    configure_tracing("pagedserve-controlplane")
    cp = await start_control_plane(config, args.host, args.grpc_port, args.http_port)
    if wait_s:
        await cp.dispatcher.wait_ready(wait_s)
    print(
        f"pagedserve gRPC on {args.host}:{cp.grpc_port}  HTTP on http://{args.host}:{cp.http_port}",
        flush=True,
    )
    await run_until_signalled(cp)


def engine_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The engine flags the user gave `serve`, rebuilt for the data-plane child."""
    from dataplane.cli import ENGINE_GROUP_TITLE

    argv: list[str] = []
    for group in parser._action_groups:
        if group.title != ENGINE_GROUP_TITLE:
            continue
        for action in group._group_actions:
            value = getattr(args, action.dest)
            if value == action.default or not action.option_strings:
                continue
            flag = action.option_strings[0]
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif action.nargs == 0:
                argv.append(flag)
            else:
                argv += [flag, str(value)]
    return argv


def cmd_serve(args: argparse.Namespace) -> int:
    child_argv = [sys.executable, "-m", "dataplane.cli", "dataplane", "--host", "127.0.0.1"]
    child_argv += ["--port", str(args.dataplane_port), *engine_argv(args._parser, args)]
    # The child gets its own process group: Ctrl-C reaches us, and we stop it in order.
    child = subprocess.Popen(child_argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        address = _await_listening(child)
        config = _config(args, (address,))
        asyncio.run(_run_controlplane(config, args, wait_s=30.0))
    finally:
        _stop_child(child)
    return 0


def _await_listening(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    for line in child.stdout:
        print(line, end="", flush=True)
        if "listening on" in line:
            # Keep draining the child's stdout so it can never block on a full pipe.
            threading.Thread(target=_forward, args=(child.stdout,), daemon=True).start()
            return line.rsplit(" ", 1)[-1].strip()
    code = child.wait()
    raise RuntimeError(f"the data plane exited with code {code} before listening (see its log above)")


def _forward(stream: Any) -> None:
    for line in stream:
        print(line, end="", flush=True)


def _stop_child(child: subprocess.Popen[str], timeout_s: float = 15.0) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
