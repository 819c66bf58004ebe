"""Log lines a person can read on a terminal, JSON for everything else (real processes, their
stderr a pseudo-terminal or a pipe): `--log-format auto` (the default) follows stderr,
`console` and `json` force one, and `serve`'s data-plane child logs as `serve` does, so a
terminal never shows both kinds of line."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.harness import REPO, wait_until

START_S = 120.0


class Launched:
    """`pagedserve ARGV` with stderr on a pseudo-terminal (`tty`) or a pipe, read as it comes;
    stdout to a file."""

    def __init__(self, argv: list[str], tty: bool, out: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_LOG_FORMAT"}
        self.out = out
        self.text = ""
        if tty:
            reader, writer = pty.openpty()
        else:
            reader, writer = os.pipe()
        with out.open("w") as stdout:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve", *argv],
                stdout=stdout,
                stderr=writer,
                cwd=REPO,
                env={**env, "PYTHONPATH": str(REPO)},
                start_new_session=True,
            )
        os.close(writer)
        self._reader = reader
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._reader, 65536)
            except OSError:  # a pty's reader fails with EIO once every writer is gone
                break
            if not chunk:
                break
            self.text += chunk.decode(errors="replace")

    def lines_with(self, event: str) -> list[str]:
        return [line for line in self.text.splitlines() if event in line]

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            self._thread.join(10)
            os.close(self._reader)
        return code


def is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line.strip()), dict)
    except ValueError:
        return False


def controlplane(tiny: Path, tmp_path: Path, tty: bool, *flags: str) -> list[str]:
    """The `dataplane_added` line a control plane logs as it starts."""
    argv = ["controlplane", "--model", str(tiny), "--dataplane", "127.0.0.1:1", "--grpc-port", "0"]
    launched = Launched([*argv, "--http-port", "0", *flags], tty, tmp_path / "cp.out")
    try:
        wait_until(
            lambda: launched.lines_with("dataplane_added"), START_S, "the control plane's first log line"
        )
    finally:
        launched.stop()
    return launched.lines_with("dataplane_added")


@pytest.mark.parametrize(
    ("tty", "flags", "expect_json"),
    [
        (True, (), False),  # a terminal, by default: readable
        (False, (), True),  # a pipe (a collector, a file), by default: JSON
        (True, ("--log-format", "json"), True),
        (False, ("--log-format", "console"), False),
    ],
)
def test_the_control_planes_log_format(
    tiny: Path, tmp_path: Path, tty: bool, flags: tuple[str, ...], expect_json: bool
) -> None:
    (line,) = controlplane(tiny, tmp_path, tty, *flags)
    assert is_json(line) == expect_json, line
    if not expect_json:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)  # (colours on a terminal)
        assert re.search(r"\[info\s*\] dataplane_added\s+address=127\.0\.0\.1:1", plain), plain


@pytest.mark.parametrize("log_format", ["json", "auto"])
def test_serves_data_plane_logs_as_serve_does(tiny: Path, tmp_path: Path, log_format: str) -> None:
    argv = ["serve", "--model", str(tiny), "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
    argv += ["--num-gpu-blocks-override", "16", "--max-model-len", "128", "--log-format", log_format]
    launched = Launched(argv, True, tmp_path / "serve.out")
    try:
        deadline = time.monotonic() + START_S
        while "gRPC on" not in launched.out.read_text():
            assert launched.proc.poll() is None and time.monotonic() < deadline, launched.text[-3000:]
            time.sleep(0.05)
    finally:
        launched.stop()
    child = launched.lines_with("startup_phase")  # the data plane's (the child's) lines
    own = launched.lines_with("controlplane_stopping")  # serve's own
    assert child and own, launched.text[-3000:]
    expect_json = log_format == "json"  # auto on a terminal: readable, the child's lines too
    assert all(is_json(line) == expect_json for line in child + own), launched.text[-3000:]
