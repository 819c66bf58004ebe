"""`benchmarks/src/pagedserve/benchmarks/server_process.py`: a server the benchmark launches is ready when /health says
200, and is gone, with every process it started, however the run ends.

A fake server (a Python script: one child process, like `pagedserve serve`'s data plane or
vLLM's engine core, then an HTTP server) stands in for the real ones; every wait is bounded.
The launcher against the real `pagedserve serve` is in test_serve_peer_cli.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.benchmarks.server_process import ServerSpec, group_members, healthy, launch, sigterm_exits
from pagedserve.common.lifecycle import free_port

FAKE_SERVER = """
import http.server, os, signal, subprocess, sys, time
port, mode, pid_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
open(pid_file, "w").write(str(os.getpid()))
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a child of its own
print("fake server starting", flush=True)
if mode == "exit":
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
status = 503 if mode == "never-ready" else 200

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

time.sleep(0.3)  # not ready at once
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return script


def spec(script: Path, mode: str, pid_file: Path) -> ServerSpec:
    port = free_port()
    return ServerSpec("fake", [sys.executable, str(script), str(port), mode, str(pid_file)], port)


def server_pid(pid_file: Path) -> int:
    for _ in range(100):  # written first thing; the launcher returns only after that anyway
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError("the fake server never wrote its pid")


def test_ready_on_health_then_stopped_with_its_children(fake: Path, tmp_path: Path) -> None:
    pid_file, log = tmp_path / "pid", tmp_path / "logs" / "fake.log"
    s = spec(fake, "ok", pid_file)
    with launch(s, log, timeout_s=60) as url:
        assert url == f"http://127.0.0.1:{s.port}"
        assert healthy(url)
        pid = server_pid(pid_file)
        assert os.getpgid(pid) == pid  # its own group: the shim exec'd into the server
        assert len(group_members(pid)) == 2  # the server and its child
    assert group_members(pid) == []
    assert not healthy(url)
    assert "fake server starting" in log.read_text()


def test_a_server_that_exits_before_ready_fails_at_once_with_its_log(fake: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with (
        pytest.raises(RuntimeError, match="fake exited with 3 before it was ready") as err,
        launch(spec(fake, "exit", pid_file), tmp_path / "fake.log", timeout_s=60),
    ):
        raise AssertionError("not reached")
    assert "fake server starting" in str(err.value)  # the log's tail
    assert group_members(server_pid(pid_file)) == []  # its child was stopped too


def test_a_server_never_ready_times_out_naming_the_flag(fake: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with (
        pytest.raises(TimeoutError, match=r"did not answer .*/health within 2 s \(--launch-timeout"),
        launch(spec(fake, "never-ready", pid_file), tmp_path / "fake.log", timeout_s=2),
    ):
        raise AssertionError("not reached")
    assert group_members(server_pid(pid_file)) == []


def test_ctrl_c_inside_the_run_stops_the_server(fake: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with (
        pytest.raises(KeyboardInterrupt),
        launch(spec(fake, "ok", pid_file), tmp_path / "fake.log", timeout_s=60),
    ):
        raise KeyboardInterrupt
    assert group_members(server_pid(pid_file)) == []


def test_a_server_ignoring_sigterm_is_killed_after_the_grace(fake: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with launch(spec(fake, "stubborn", pid_file), tmp_path / "fake.log", timeout_s=60, grace_s=1):
        pid = server_pid(pid_file)
    assert group_members(pid) == []


def test_sigterm_to_the_benchmark_becomes_an_exit_that_runs_the_teardown(fake: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    before = signal.getsignal(signal.SIGTERM)
    with (
        pytest.raises(SystemExit) as exc,
        sigterm_exits(),
        launch(spec(fake, "ok", pid_file), tmp_path / "fake.log", timeout_s=60),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
    assert exc.value.code == 128 + signal.SIGTERM
    assert group_members(server_pid(pid_file)) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_killed_benchmark_takes_its_server_with_it(fake: Path, tmp_path: Path) -> None:
    """SIGKILL runs no Python: the kernel's parent-death signal stops the server."""
    pid_file = tmp_path / "pid"
    port = free_port()
    bench = f"""
import sys, time
from pathlib import Path
from pagedserve.benchmarks.server_process import ServerSpec, launch
spec = ServerSpec("fake", [sys.executable, {str(fake)!r}, "{port}", "ok", {str(pid_file)!r}], {port})
with launch(spec, Path({str(tmp_path / "fake.log")!r}), timeout_s=60):
    print("ready", flush=True)
    time.sleep(600)
"""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", bench], cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        pid = server_pid(pid_file)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid in group_members(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in group_members(pid)
    finally:
        proc.kill()
        if pid_file.exists():  # leave nothing behind, whatever failed
            for member in group_members(int(pid_file.read_text())):
                os.kill(member, signal.SIGKILL)
