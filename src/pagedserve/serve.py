"""`pagedserve serve`: one control plane plus one data plane, the data plane as a child process.

The child gets its whole DataPlaneConfig as JSON (`pagedserve dataplane --config-json`): the
engine settings travel as the config they are, never rebuilt into flags.

Order and supervision:

1. The public ports are bound first (the control plane starts), so a second `serve` on a taken
   port fails at once with one line, before any model loads; a model that is not pulled fails
   there too.
2. The data plane child starts on a loopback port and loads the model; `serve` announces its
   ports once the child serves (`/health` says 503 until then).
3. When the child dies, `serve` restarts it after a backoff (`/health` 503 meanwhile). More
   than `--dataplane-max-restarts` deaths within `--dataplane-restart-window` seconds (or a
   first start that never serves) and `serve` gives up: `/live` fails and it exits 1, for an
   orchestrator to restart the whole.
4. The child dies with `serve` (Linux `PR_SET_PDEATHSIG`, `--exit-with-parent`), even when
   `serve` is SIGKILLed.
5. The link between the two planes is authenticated, loopback included: without a
   `--dataplane-token-file`, `serve` makes a random token for this start (a 0600 file, removed
   when `serve` exits) and hands it to both planes, so no other local process can submit to the
   data plane past `--api-key` and admission, or drain it.
6. SIGINT/SIGTERM: the control plane drains for `--shutdown-grace` while the child serves,
   cuts the streams still open, then the child is stopped (SIGTERM; SIGKILL if it still runs
   shortly before the deadline): `serve` and its child are gone within the grace +
   `STOP_MARGIN_S` (2 s) of the signal, whatever the clients do. A second signal cuts at once
   and SIGKILLs the child: gone within `HURRY_S` (1 s); a third ends `serve` at once. Past a
   deadline a watchdog thread kills the child and exits (`StopSignals`).

Exit codes: 0 after SIGINT/SIGTERM while serving, 130/143 for one during start-up (or when
the stop deadline's watchdog ended the process), 1 when the data plane could not be kept
running (or on a start-up error).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pagedserve.common import settings
from pagedserve.common.lifecycle import (
    EXIT_ERROR,
    check_port_free,
    cli_command,
    free_port,
    print_error,
)
from pagedserve.common.log_format import LoggingConfig
from pagedserve.common.settings import setting
from pagedserve.controlplane.cli import add_controlplane_args, config_from_args, ready_line
from pagedserve.dataplane.config import ENDPOINT_SETTINGS, DataPlaneConfig

_READY_POLL_S = 0.05
_STOP_CHILD_S = 15.0  # a SIGTERMed child's time to exit, with no signal's deadline to keep
_KILLED_CHILD_S = 5.0  # a SIGKILLed child is gone by then (else it is left, not waited on)
# A stop's child is SIGKILLed this much before the signal's deadline: what is left is this
# process's own exit, the interpreter's teardown included, which no watchdog thread covers.
_DEADLINE_EARLY_S = 0.75


STOPPED_STARTING = (
    "pagedserve: stopping: the data plane had not loaded the model yet (requests waiting for it "
    "are refused); Ctrl-C again (or a second SIGTERM) stops at once"
)


@dataclass(frozen=True)
class SupervisionConfig:
    """How `serve` keeps its data plane running: a dead one is restarted after
    `min(restart_backoff_s * 2**(deaths in the window - 1), restart_backoff_max_s)`; more than
    `dataplane_max_restarts` deaths within `dataplane_restart_window_s` and `serve` exits 1."""

    dataplane_max_restarts: int = setting(
        5, "restarts of a dead data plane within the restart window before `serve` gives up and exits 1"
    )
    dataplane_restart_window_s: float = setting(
        300.0, "seconds over which data-plane deaths count", flag="--dataplane-restart-window"
    )
    restart_backoff_s: float = setting(1.0, "first delay before restarting a dead data plane", cli=False)
    restart_backoff_max_s: float = setting(30.0, "longest delay before restarting it", cli=False)

    def __post_init__(self) -> None:
        if self.dataplane_max_restarts < 0:
            raise ValueError(f"dataplane_max_restarts must be >= 0, got {self.dataplane_max_restarts}")
        if self.dataplane_restart_window_s <= 0:
            raise ValueError(f"dataplane_restart_window_s must be > 0, got {self.dataplane_restart_window_s}")
        if not 0 <= self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ValueError("restart_backoff_s must be in [0, restart_backoff_max_s]")


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model: one control plane plus one data plane (child process)",
        formatter_class=settings.HelpFormatter,
    )
    serve.add_argument(
        "--dataplane-port", type=int, default=0, help="the data plane's internal gRPC port (0: a free one)"
    )
    add_controlplane_args(serve, own_dataplane=True)
    settings.add_arguments(serve, SupervisionConfig, title="supervision")
    settings.add_arguments(serve, LoggingConfig, title="logging")  # (the child logs the same way)
    # Every data-plane setting but the child's endpoint, which `serve` sets (ENDPOINT_SETTINGS).
    settings.add_arguments(serve, DataPlaneConfig, title="data plane", skip=ENDPOINT_SETTINGS)
    serve.set_defaults(func=cmd_serve)


def dataplane_config(args: argparse.Namespace) -> DataPlaneConfig:
    """The child's config: the data-plane and engine settings given to `serve`, on a loopback
    port (chosen here, so the control plane knows the address before the child starts)."""
    values = {name: value for name, value in vars(args).items() if name not in ENDPOINT_SETTINGS}
    values |= {
        "host": "127.0.0.1",
        "port": args.dataplane_port or free_port("127.0.0.1"),
        "dataplane_token_file": args.dataplane_token_file,
    }
    return settings.from_arguments(DataPlaneConfig, values)


def child_command(config: DataPlaneConfig) -> list[str]:
    return [sys.executable, "-m", "pagedserve", "dataplane", "--config-json", settings.to_json(config)]


LINK_TOKEN_BYTES = 32


@contextlib.contextmanager
def link_token(token_file: str | None) -> Iterator[str]:
    """The planes' shared token file while `serve` runs: the operator's `--dataplane-token-file`,
    else one made for this start (random, in a file only this user reads, removed on the way out)."""
    if token_file is not None:
        yield token_file
        return
    fd, path = tempfile.mkstemp(prefix="pagedserve-link-", suffix=".token")  # mode 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(LINK_TOKEN_BYTES))
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@cli_command
def cmd_serve(args: argparse.Namespace) -> int:
    with link_token(args.dataplane_token_file) as token_file:
        # Both planes read the token file from the arguments: the child's config and the control plane's.
        args = argparse.Namespace(**{**vars(args), "dataplane_token_file": token_file})
        child = dataplane_config(args)  # engine settings are checked before anything starts
        supervision = settings.from_arguments(SupervisionConfig, args)
        return asyncio.run(_serve(args, child, supervision))


async def _serve(args: argparse.Namespace, child: DataPlaneConfig, supervision: SupervisionConfig) -> int:
    from pagedserve.common.telemetry import configure_tracing
    from pagedserve.controlplane.server import start_control_plane, stop_signals

    configure_tracing("pagedserve-controlplane")
    if args.dataplane_port:
        check_port_free(child.host, child.port, "--dataplane-port")
    config = config_from_args(args, dataplanes=(f"{child.host}:{child.port}",), dataplane_dns=None)
    cp = await start_control_plane(config, args.host, args.grpc_port, args.http_port)
    signals = stop_signals(cp)
    stopped = signals.first
    supervisor = Supervisor(child_command(child), supervision)
    signals.before_hard_exit = supervisor.kill  # (from the watchdog thread)
    supervisor.start()
    shut_down = False  # cp.shutdown() ends with cp.stop()
    try:
        while not (cp.dispatcher.healthy or stopped.done() or supervisor.gave_up.is_set()):
            await asyncio.sleep(_READY_POLL_S)
        ready = bool(cp.dispatcher.healthy) and not stopped.done()
        if ready:
            print(ready_line(args.host, cp.grpc_port, cp.http_port, config.tls is not None), flush=True)
            gave_up = asyncio.ensure_future(supervisor.gave_up.wait())
            waiters: set[asyncio.Future[Any]] = {stopped, gave_up}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            gave_up.cancel()
        if supervisor.gave_up.is_set() and not stopped.done():
            cp.liveness.fail(supervisor.failure)
            print_error(supervisor.failure)
            return EXIT_ERROR
        _log().info("serve_stopping", signal=signal.Signals(stopped.result()).name)
        if not ready:  # (once serving, the control plane's shutdown says what it waits for)
            print(STOPPED_STARTING, flush=True)
        if ready:
            # As `pagedserve controlplane`: NOT_SERVING, new work refused, streams under way get
            # the shutdown grace (a second signal ends it) while the data plane still runs.
            shut_down = True
            await cp.shutdown(config.shutdown_grace_s, signals.second)
        return 0 if ready else 128 + stopped.result()
    finally:
        # Control plane first (its streams end, its links half-close), then the child, which
        # is SIGKILLed if it has not exited shortly before the signal's deadline.
        if not shut_down:
            await cp.stop(grace_s=0.0 if stopped.done() else 2.0)
        timeout_s = max(0.0, signals.remaining(0.0) - _DEADLINE_EARLY_S) if stopped.done() else None
        await supervisor.stop(timeout_s, signals.second)


def _log() -> Any:
    from pagedserve.common.log import get_logger  # not at import: `pagedserve --help` stays light

    return get_logger(__name__)


class Supervisor:
    """Runs the data-plane child and restarts it when it dies (see the module docstring).
    `gave_up` is set, with the reason in `failure`, when it stops trying."""

    def __init__(self, command: list[str], config: SupervisionConfig) -> None:
        self.command = command
        self.config = config
        self.gave_up = asyncio.Event()
        self.failure = ""
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._deaths: list[float] = []
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="dataplane-supervisor")

    async def stop(self, timeout_s: float | None = None, hurry: asyncio.Future[Any] | None = None) -> None:
        """Stop supervising and stop the child: SIGTERM, then SIGKILL after `timeout_s`
        (default _STOP_CHILD_S) or as soon as `hurry` completes (at once if it has)."""
        self._stopping = True
        if self._task is not None:  # first, so no child is started after this
            self._task.cancel()
            await asyncio.wait({self._task})
        process = self.process
        if process is None or process.returncode is not None:
            return
        if hurry is None or not hurry.done():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            exited = asyncio.ensure_future(process.wait())
            waiters: set[asyncio.Future[Any]] = {exited} if hurry is None else {exited, hurry}
            await asyncio.wait(
                waiters,
                timeout=_STOP_CHILD_S if timeout_s is None else timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            exited.cancel()
        if process.returncode is None:
            self.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), _KILLED_CHILD_S)

    def kill(self) -> None:
        """SIGKILL the child's process group now (any thread: the hard-exit watchdog's too)."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    async def _supervise(self) -> None:
        try:
            await self._keep_running()
        except Exception as exc:  # e.g. the child cannot be started at all
            self._give_up(f"cannot run the data plane: {exc}")

    async def _keep_running(self) -> None:
        served_once = False
        while not self._stopping:
            process = await self._spawn()
            serving = asyncio.Event()
            forward = asyncio.create_task(_forward(process, serving))
            code = await process.wait()
            await asyncio.wait({forward}, timeout=1.0)
            forward.cancel()
            if self._stopping:
                return
            served_once = served_once or serving.is_set()
            how = _describe_exit(code)
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < self.config.dataplane_restart_window_s]
            self._deaths.append(now)
            if not served_once:
                self._give_up(f"the data plane {how} before it was serving (see its log above)")
                return
            if len(self._deaths) > self.config.dataplane_max_restarts:
                window = self.config.dataplane_restart_window_s
                self._give_up(
                    f"the data plane {how}; it died {len(self._deaths)} times within {window:g} s, "
                    f"more than --dataplane-max-restarts {self.config.dataplane_max_restarts}: giving up"
                )
                return
            delay = min(
                self.config.restart_backoff_s * 2 ** (len(self._deaths) - 1),
                self.config.restart_backoff_max_s,
            )
            _log().warning("dataplane_died", exit=how, restart_in_s=delay, deaths_in_window=len(self._deaths))
            await asyncio.sleep(delay)
            self.restarts += 1

    async def _spawn(self) -> asyncio.subprocess.Process:
        # Its own process group: Ctrl-C reaches us, and we stop the child in order. It dies
        # with us (--exit-with-parent); the fork happens on this, the main, thread, which the
        # kernel's parent-death signal follows.
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            "--exit-with-parent",
            str(os.getpid()),
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        print(f"pagedserve serve: starting the data plane (pid {self.process.pid})", flush=True)
        return self.process

    def _give_up(self, reason: str) -> None:
        self.failure = reason
        _log().error("dataplane_given_up", reason=reason)
        self.gave_up.set()


async def _forward(process: asyncio.subprocess.Process, serving: asyncio.Event) -> None:
    """Copy the child's stdout to ours as it comes (it can never block on a full pipe, however
    long its lines); set `serving` when it says it listens."""
    assert process.stdout is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail = ""
    while chunk := await process.stdout.read(1 << 16):
        text = decoder.decode(chunk)
        sys.stdout.write(text)
        sys.stdout.flush()
        if not serving.is_set():
            tail = (tail + text)[-4096:]
            if "listening on" in tail:
                serving.set()


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
