"""The server processes as an operator meets them, with real processes on a tiny model.

Two servers on one port (the second exits at once with one line, before loading a model, and
the first keeps the port); a data plane killed under `serve` (restarted, serving again within
30 s; or, with no restarts left, `serve` exits 1); `serve` killed with SIGKILL (its data plane
gone within 2 s); Ctrl-C during start-up and a model that is not pulled (an exit code and one
line, no traceback). Every wait is bounded.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.clients.python import GenerationClient
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc
from pagedserve.serve import STOPPED_STARTING
from tests.e2e.harness import REPO, wait_until

START_S = 120.0  # a cold start imports torch; two cores may be busy with other tests
LOG_NOISE = ("Traceback", "Task was destroyed", "asynchronous generator is already running", "sys.excepthook")


def gone(pid: int) -> bool:
    """The process has exited (a zombie left for a reaper that is not us counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def reaped(pid: int) -> bool:
    """The process has exited and its parent has collected it (no `<defunct>` entry)."""
    return not Path(f"/proc/{pid}").exists()


class Proc:
    """A `pagedserve` subprocess whose stdout and stderr go to files (no pipe can fill up)."""

    def __init__(self, argv: list[str], directory: Path, name: str) -> None:
        self.out_path, self.err_path = directory / f"{name}.out", directory / f"{name}.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve", *argv],
                stdout=out,
                stderr=err,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                start_new_session=True,
            )

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, pattern: str, timeout_s: float = START_S, count: int = 1) -> re.Match[str]:
        """The `count`-th match of `pattern` in stdout; fails if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            matches = list(re.finditer(pattern, self.stdout))
            if len(matches) >= count:
                return matches[count - 1]
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited with {self.proc.returncode} before {pattern!r}:\n{self.stdout}\n{self.stderr[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {pattern!r} within {timeout_s}s:\n{self.stdout}\n{self.stderr[-3000:]}"
                )
            time.sleep(0.05)

    def exit_code(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def child_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"starting the data plane \(pid (\d+)\)", self.stdout)]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=20)
        for pid in self.child_pids():  # the data plane dies with `serve`; make sure of it
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def serve_argv(model: Path, *extra: str) -> list[str]:
    argv = ["serve", "--model", str(model), "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
    return [*argv, "--num-gpu-blocks-override", "32", "--max-model-len", "256", *extra]


class Serve(Proc):
    def __init__(self, model: Path, directory: Path, name: str, *extra: str) -> None:
        super().__init__(serve_argv(model, *extra), directory, name)

    def wait_serving(self) -> None:
        line = self.wait_for(r"gRPC on (\S+)  HTTP on (\S+)")
        self.grpc_address, self.http_url = line.group(1), line.group(2)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1


def generates(address: str) -> bool:
    try:
        with GenerationClient(address, timeout=10) as client:
            return client.generate([5, 6, 7], max_tokens=2)[0].completion_tokens == 2
    except Exception:
        return False


def assert_one_line_error(proc: Proc, message: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pagedserve: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert not any(noise in proc.stderr for noise in LOG_NOISE), proc.stderr


@pytest.fixture(scope="module")
def serving(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    srv = Serve(tiny, tmp_path_factory.mktemp("serve"), "first")
    try:
        srv.wait_serving()
        yield srv
    finally:
        srv.cleanup()


def test_a_second_server_on_a_taken_port_exits_at_once_and_the_first_keeps_it(
    serving: Serve, tiny: Path, tmp_path: Path
) -> None:
    grpc_port = serving.grpc_address.rsplit(":", 1)[1]
    http_port = serving.http_url.rsplit(":", 1)[1]
    second = {
        "serve-grpc": ["serve", "--model", str(tiny), "--grpc-port", grpc_port, "--http-port", "0"],
        "serve-http": ["serve", "--model", str(tiny), "--grpc-port", "0", "--http-port", http_port],
        "controlplane": [
            "controlplane",
            "--model",
            str(tiny),
            "--dataplane",
            "127.0.0.1:1",
            "--grpc-port",
            grpc_port,
        ],
        "dataplane": ["dataplane", "--model", str(tiny), "--port", grpc_port],
    }
    for name, argv in second.items():
        proc = Proc(argv, tmp_path, name)
        try:
            started = time.monotonic()
            assert proc.exit_code(timeout_s=30) == 1, name
            port = http_port if name == "serve-http" else grpc_port
            assert_one_line_error(proc, f"port {port} is already in use")
            assert "starting the data plane" not in proc.stdout and "loading" not in proc.stdout, name
            assert time.monotonic() - started < 20, name  # no model was loaded
        finally:
            proc.cleanup()
    # The first server still has its ports to itself.
    assert generates(serving.grpc_address)
    assert http_status(f"{serving.http_url}/health") == 200


def test_a_killed_data_plane_is_restarted_and_serves_again(serving: Serve) -> None:
    (child,) = serving.child_pids()
    os.kill(child, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: reaped(child), 5, "the dead data plane reaped (no <defunct> child)")
    wait_until(lambda: http_status(f"{serving.http_url}/health") == 503, 10, "/health 503 while it is down")
    assert http_status(f"{serving.http_url}/live") == 200  # restarting: still alive
    serving.wait_for(r"starting the data plane \(pid \d+\)", timeout_s=30, count=2)
    wait_until(lambda: generates(serving.grpc_address), 30 - (time.monotonic() - killed), "serving again")
    assert time.monotonic() - killed < 30
    assert http_status(f"{serving.http_url}/health") == 200
    assert serving.proc.poll() is None
    assert not any(noise in serving.stderr for noise in LOG_NOISE), serving.stderr[-3000:]


def child_config(pid: int) -> dict[str, object]:
    """The data-plane child's settings, read from its command line (`--config-json`)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    config: dict[str, object] = json.loads(argv[argv.index(b"--config-json") + 1])
    return config


def test_the_link_between_the_planes_needs_this_starts_token_even_on_loopback(serving: Serve) -> None:
    child = serving.child_pids()[-1]  # the one running now (an earlier test may have killed one)
    config = child_config(child)
    token_file = Path(str(config["dataplane_token_file"]))
    assert token_file.stat().st_mode & 0o777 == 0o600  # only this user reads it
    address = f"{config['host']}:{config['port']}"
    with grpc.insecure_channel(address) as channel:
        stub = dataplane_pb2_grpc.DataPlaneServiceStub(channel)
        with pytest.raises(grpc.RpcError) as drain:
            stub.Drain(dataplane_pb2.DrainRequest(), timeout=30)
        assert drain.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as connect:
            list(stub.Connect(iter([dataplane_pb2.ConnectRequest()]), timeout=30))
        assert connect.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The stray calls changed nothing: the control plane's own link carries the token.
    assert generates(serving.grpc_address)
    assert http_status(f"{serving.http_url}/health") == 200


def test_serve_exits_non_zero_when_its_data_plane_keeps_dying(tiny: Path, tmp_path: Path) -> None:
    srv = Serve(tiny, tmp_path, "fragile", "--dataplane-max-restarts", "0")
    try:
        srv.wait_serving()
        (child,) = srv.child_pids()
        token_file = Path(str(child_config(child)["dataplane_token_file"]))
        assert token_file.exists()
        os.kill(child, signal.SIGKILL)
        assert srv.exit_code(timeout_s=30) == 1
        assert_one_line_error(srv, "giving up")
        assert len(srv.child_pids()) == 1  # no restart was tried
        assert not token_file.exists()  # this start's link token goes with it
    finally:
        srv.cleanup()


def test_the_data_plane_dies_with_a_killed_serve(tiny: Path, tmp_path: Path) -> None:
    srv = Serve(tiny, tmp_path, "killed")
    try:
        srv.wait_serving()
        (child,) = srv.child_pids()
        os.kill(srv.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: gone(child), 2.0, "the data plane gone after `serve` was SIGKILLed")
        assert time.monotonic() - killed < 2.0
    finally:
        srv.cleanup()


@pytest.mark.parametrize("command", ["serve", "dataplane"])
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(
    command: str, tiny: Path, tmp_path: Path
) -> None:
    if command == "serve":
        proc: Proc = Serve(tiny, tmp_path, "interrupted")
        marker = r"starting the data plane \(pid \d+\)"
    else:
        proc = Proc(
            ["dataplane", "--model", str(tiny), "--port", "0", "--threads", "1"], tmp_path, "interrupted"
        )
        marker = r"pagedserve dataplane loading"  # printed just before torch is imported
    try:
        proc.wait_for(marker, timeout_s=60)
        os.killpg(proc.proc.pid, signal.SIGINT)
        # 130, or ended by SIGINT itself, which a shell reports as the same status 130: about
        # one `dataplane` run in ten handled the KeyboardInterrupt (its server stopped, atexit
        # ran) and then died of SIGINT during the interpreter's finalization.
        assert proc.exit_code(timeout_s=20) in (130, -signal.SIGINT)
        assert "listening on" not in proc.stdout  # it was interrupted while loading
        if command == "serve":  # one line says what the stop is about
            assert proc.stdout.count("pagedserve: stopping:") == 1
            assert STOPPED_STARTING in proc.stdout
        assert not any(noise in proc.stderr for noise in LOG_NOISE), proc.stderr
        for child in proc.child_pids():
            wait_until(functools.partial(gone, child), 10, "the data plane stopped")
    finally:
        proc.cleanup()


@pytest.mark.parametrize("command", ["serve", "dataplane"])
def test_a_model_that_is_not_pulled_is_one_line(command: str, tmp_path: Path) -> None:
    argv = [command, "--model", "SmolLM2-135M-Instruct", "--model-home", str(tmp_path / "store")]
    argv += ["--grpc-port", "0", "--http-port", "0"] if command == "serve" else ["--port", "0"]
    proc = Proc(argv, tmp_path, "unpulled")
    try:
        assert proc.exit_code(timeout_s=30) == 1
        assert_one_line_error(proc, "pagedserve models pull SmolLM2-135M-Instruct")
        assert not proc.child_pids()
    finally:
        proc.cleanup()
