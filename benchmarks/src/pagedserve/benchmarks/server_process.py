"""A server the benchmark starts itself: launch, wait until ready, stop with everything it started.

    with launch(ServerSpec("pagedserve", argv, port), log_path, timeout_s=600) as url:
        ...  # url = "http://127.0.0.1:PORT", GET /health answered 200

- The server runs in a process group of its own (a new session), so stopping it reaches the
  processes it started too (`pagedserve serve`'s data plane, vLLM's engine core) and a Ctrl-C
  at the terminal reaches only the benchmark, which then stops the server itself.
- Its stdout and stderr go to `log_path` (no pipe to fill up; kept for diagnosis).
- Ready means `GET /health` answers 200 (both `pagedserve serve` and `vllm serve` say 200 only
  once the model is loaded). The wait is bounded; a server that exits first fails at once,
  with the tail of its log.
- On every way out of the `with` (done, an exception, Ctrl-C, SIGTERM turned into an exit by
  `sigterm_exits`): SIGTERM to the group, SIGKILL to whatever is left after `grace_s`, then a
  bounded wait until no process of the group is alive.
- Even a SIGKILLed benchmark leaves no server: a small shim sets the kernel's parent-death
  signal (`exit_with_parent`) and then execs the server, which gets SIGTERM when we die.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY_POLL_S = 0.5
# Runs first in the server's process: ask for SIGTERM when the benchmark dies, then become the server.
_EXEC_WITH_PARENT = (
    "import os, sys\n"
    "from pagedserve.common.lifecycle import exit_with_parent\n"
    "exit_with_parent(int(sys.argv[1]))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
# Straight to the server: a proxy set in the environment must not see loopback requests.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] | None = None  # None: this process's environment
    settings: dict[str, Any] = field(default_factory=dict)  # what the report says it ran with

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _DIRECT.open(f"{url}/health", timeout=timeout_s) as response:
            return int(response.status) == 200
    except OSError:  # refused while starting, a 503 (HTTPError), a timeout
        return False


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_ready(proc: subprocess.Popen[bytes], spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(spec.url):
        if proc.poll() is not None:
            raise RuntimeError(
                f"{spec.name} exited with {proc.returncode} before it was ready (log {log_path}):\n"
                f"{log_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{spec.name} did not answer {spec.url}/health within {timeout_s:g} s (--launch-timeout; "
                f"log {log_path}):\n{log_tail(log_path)}"
            )
        time.sleep(READY_POLL_S)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`; zombies (exited, left for a reaper that is not
    us) do not count."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def start_serve(cmd: list[str]) -> tuple[subprocess.Popen[str], str, str]:
    """Run `cmd` (a `pagedserve serve` command line with --grpc-port 0 --http-port 0 welcome)
    in a session of its own until it prints where it serves: (process, gRPC address, HTTP
    URL). Its later output is read and dropped, so the pipe never fills."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "gRPC on " in line:
            threading.Thread(target=proc.stdout.read, name="serve-output", daemon=True).start()
            grpc_address = line.split("gRPC on ", 1)[1].split()[0]
            return proc, grpc_address, line.split("HTTP on ", 1)[1].split()[0]
    raise RuntimeError(f"pagedserve serve exited with {proc.wait()} before serving")


def stop(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM the server's group, SIGKILL what is left after `grace_s`, and return once
    nothing in the group is alive (bounded: a process stuck in the kernel is reported)."""
    pgid = proc.pid  # the leader of a new session: its pid is the group's id
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)  # the leader is gone; its children are still shutting down
    if group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        print(f"warning: processes {left} of a stopped server are still alive", file=sys.stderr)


@contextlib.contextmanager
def launch(spec: ServerSpec, log_path: Path, timeout_s: float, grace_s: float = 30.0) -> Iterator[str]:
    """Start `spec`, wait (at most `timeout_s`) until it is ready and yield its URL; stop it
    and every process it started on the way out, however the block ends. Call it from the
    main thread (the parent-death signal follows the thread that started the server)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PARENT, str(os.getpid()), *spec.argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=spec.env,
            start_new_session=True,
        )
    try:
        wait_ready(proc, spec, log_path, timeout_s)
        yield spec.url
    finally:
        stop(proc, grace_s)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside: SIGTERM raises SystemExit(143), so `launch` blocks stop their servers
    (Python's default for SIGTERM ends the process without running them)."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
