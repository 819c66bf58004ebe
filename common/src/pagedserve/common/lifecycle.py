"""Start-up and exit of the server processes, shared by both planes and `serve`. No torch.

- Ports are bound first, without `SO_REUSEPORT` (`NO_REUSEPORT` on every gRPC server), so a
  second server on a taken port fails at once, before it loads anything, instead of silently
  sharing the port with the first.
- Everyday mistakes (a port in use, a missing file) are a `StartupError`: one line for the
  operator (`pagedserve: error: port 50051 is already in use`), no traceback; Ctrl-C exits
  130 quietly. `cli_command` turns both into exit codes.
- A child process can tie its life to its parent's (`exit_with_parent`).
- SIGINT/SIGTERM stop a server within a bound (`StopSignals`): the first starts a graceful stop
  that must be over `shutdown_grace_s + STOP_MARGIN_S` later, a second hurries it to within
  `HURRY_S`; past either deadline the process (its children first) is ended from a thread,
  whatever its event loop is stuck on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if (
    TYPE_CHECKING
):  # (no gRPC import at run time: dataplane/src/pagedserve/dataplane/config.py imports this module)
    import grpc

# grpcio sets SO_REUSEPORT on its listening sockets by default: two servers on one port would
# then both bind it and split the traffic between them.
NO_REUSEPORT = ("grpc.so_reuseport", 0)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

F = TypeVar("F", bound=Callable[..., int])

STOP_MARGIN_S = 2.0
"""After the shutdown grace: the most the rest of a stop takes (cut streams, close the ports,
stop the children); the process tree is gone by then."""
HURRY_S = 1.0
"""After a second SIGINT/SIGTERM: the most the stop still takes."""
_HARD_EXIT_EARLY_S = 0.25  # the hard exit comes this much before its deadline: killing takes time


class StartupError(Exception):
    """A mistake the operator fixes (a port in use, a missing file): its message is the one
    line printed, without a traceback."""


class PortInUseError(StartupError):
    """Another process already listens on the port."""


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of a gRPC listen address `host:port` (an IPv6 host in brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StartupError(f"listen address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def bind_error(host: str, port: int, exc: OSError, flag: str | None) -> StartupError:
    where = f" ({flag})" if flag else ""
    if exc.errno == errno.EADDRINUSE:
        return PortInUseError(f"port {port} is already in use{where}")
    if exc.errno == errno.EACCES:
        return StartupError(f"no permission to listen on port {port}{where}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"cannot listen on {host}: not an address of this machine")
    return StartupError(f"cannot listen on {host}:{port}{where}: {exc.strerror or exc}")


def check_port_free(host: str, port: int, flag: str | None = None) -> None:
    """Raise PortInUseError (or StartupError) when `host:port` cannot be listened on.

    A probe bind with SO_REUSEADDR: a listening socket on the port refuses it, leftover
    TIME_WAIT connections of an earlier run do not. Port 0 (any free port) always passes.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise bind_error(host, port, exc, flag) from None


def add_port(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
    flag: str | None = None,
) -> int:
    """Bind `address` on `server` (created with `NO_REUSEPORT`) now, listening from here on
    (gRPC binds at `add_*_port`, not at `start`); returns the port. `flag` names the option
    that chose the port, for the error."""
    host, port = split_address(address)
    check_port_free(host, port, flag)  # a clean error, not gRPC's own log lines
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio raises "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        check_port_free(host, port, flag)  # taken since the probe: say why, if a probe can tell
        raise StartupError(f"cannot listen on {address}" + (f" ({flag})" if flag else ""))
    return int(bound)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for a child process to bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def print_error(message: str) -> None:
    print(f"pagedserve: error: {message}", file=sys.stderr, flush=True)


def cli_command(func: F) -> F:
    """A subcommand's exit code for everyday mistakes: a StartupError prints its one line and
    exits 1, Ctrl-C exits 130; neither prints a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            return func(*args, **kwargs)
        except StartupError as exc:
            print_error(str(exc))
            return EXIT_ERROR
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    return wrapper  # type: ignore[return-value]


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` when its parent `parent_pid` dies, even by
    SIGKILL (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere nothing). If the parent is already
    gone (it died before this call), `sig` comes at once.

    Called by the child itself, first thing: the parent forks without a `preexec_fn`, which
    would make it fork (not vfork) a process running gRPC threads. The parent must start the
    child from its main thread: the signal follows the thread that forked, not the process.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


class StopSignals:
    """SIGINT and SIGTERM for a server process, for a stop that never waits on a client.

    The first signal completes `first` with its number: the caller stops gracefully (drains
    for `grace_s`, then cuts what still runs). It also sets `deadline` (monotonic) to
    `grace_s + STOP_MARGIN_S` from then. A second signal completes `second` (the caller cuts
    at once and kills its children rather than asking them) and brings the deadline forward to
    `HURRY_S` from then; a third ends the process at once. Should the process still be alive
    at its deadline, a watchdog thread calls `before_hard_exit` (`serve` sets it to SIGKILL its
    data plane) and exits with 128 + the first signal: no blocked task or thread that the
    interpreter would join at exit can keep the process, or its children, past the deadline.

    The handlers are Python-level (`signal.signal`), not the loop's (`add_signal_handler`):
    they run even while the event loop is blocked, and only hand the futures to the loop
    (`call_soon_threadsafe`). They start no thread (the main thread may hold the threading
    module's locks when a signal lands): the watchdog is started here, asleep until armed.
    """

    def __init__(self, grace_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.grace_s = grace_s
        self.first: asyncio.Future[int] = self._loop.create_future()
        self.second: asyncio.Future[int] = self._loop.create_future()
        self.deadline: float | None = None
        self.before_hard_exit: Callable[[], None] = lambda: None
        self._signals: list[int] = []
        self._armed = threading.Event()
        threading.Thread(target=self._watch, name="stop-deadline", daemon=True).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def remaining(self, default: float) -> float:
        """Seconds until the deadline (at least 0), or `default` while there is none."""
        return default if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _on_signal(self, sig: int, frame: object) -> None:
        self._signals.append(sig)
        future: asyncio.Future[int] | None = None
        if len(self._signals) == 1:
            seconds, future = self.grace_s + STOP_MARGIN_S, self.first
        elif len(self._signals) == 2:
            seconds, future = HURRY_S, self.second
        else:
            seconds = 0.0  # a third: the watchdog ends the process now
        deadline = time.monotonic() + seconds
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline
        self._armed.set()
        if future is not None:
            try:
                self._loop.call_soon_threadsafe(_complete, future, sig)
            except RuntimeError:  # the loop is closed: the process is in its last teardown
                self.deadline = time.monotonic()

    def _watch(self) -> None:
        self._armed.wait()
        while True:  # (re-read every turn: a second signal brings the deadline forward)
            assert self.deadline is not None
            left = self.deadline - _HARD_EXIT_EARLY_S - time.monotonic()
            if left <= 0:
                self._hard_exit()
            time.sleep(min(left, 0.05))

    def _hard_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.before_hard_exit()
        code = 128 + self._signals[0]
        # One line on stderr, written from yet another thread: were stderr a full pipe the
        # write would block, and the exit must not wait for it.
        line = f"pagedserve: error: not stopped by its deadline: exiting now ({code})\n".encode()
        writer = threading.Thread(target=os.write, args=(2, line), daemon=True)
        writer.start()
        writer.join(0.1)
        os._exit(code)


def _complete(future: asyncio.Future[int], sig: int) -> None:
    if not future.done():
        future.set_result(sig)
