"""`pagedserve serve`: one control plane plus one data plane, the data plane as a child process.

The child gets its whole DataPlaneConfig as JSON (`pagedserve dataplane --config-json`): the
engine settings travel as the config they are, never rebuilt into flags.
"""

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

from controlplane.cli import add_controlplane_args, config_from_args, run_controlplane
from dataplane.config import DataPlaneConfig, add_engine_args, engine_config_from_args
from pagedserve.common import settings


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model: one control plane plus one data plane (child process)",
        formatter_class=settings.HelpFormatter,
    )
    serve.add_argument("--dataplane-port", type=int, default=0, help="the data plane's internal gRPC port")
    add_controlplane_args(serve, own_dataplane=True)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def dataplane_config(args: argparse.Namespace) -> DataPlaneConfig:
    """The child's config: the engine settings given to `serve`, on a loopback port."""
    return DataPlaneConfig(host="127.0.0.1", port=args.dataplane_port, engine=engine_config_from_args(args))


def child_command(config: DataPlaneConfig) -> list[str]:
    return [sys.executable, "-m", "pagedserve", "dataplane", "--config-json", settings.to_json(config)]


def cmd_serve(args: argparse.Namespace) -> int:
    # The child gets its own process group: Ctrl-C reaches us, and we stop it in order.
    child = subprocess.Popen(
        child_command(dataplane_config(args)), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        address = _await_listening(child)
        config = config_from_args(args, dataplanes=(address,), dataplane_dns=None)
        asyncio.run(run_controlplane(config, args.host, args.grpc_port, args.http_port, wait_s=30.0))
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
