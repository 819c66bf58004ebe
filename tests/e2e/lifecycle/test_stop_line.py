"""Ctrl-C on `serve` says, in one line a person reads, what the stop waits for, how long at
most, and that a second Ctrl-C stops at once (real processes, a tiny model).

A request is held in progress by stopping the data-plane child (SIGSTOP) before it is sent:
the control plane has admitted it, and no token can come, so the stop has exactly one request
to wait for whatever the machine's speed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.clients.python import GenerationClient
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.controlplane.server import stopping_line
from tests.e2e.harness import wait_until
from tests.e2e.lifecycle.test_process_lifecycle import LOG_NOISE, Serve

GRACE_S = 2.0


@pytest.fixture
def serve(tiny: Path, tmp_path: Path) -> Iterator[Serve]:
    srv = Serve(tiny, tmp_path, "serve", "--shutdown-grace", f"{GRACE_S:g}")
    try:
        srv.wait_serving()
        yield srv
    finally:
        for pid in srv.child_pids():  # never leave a stopped child behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        srv.cleanup()


def requests_in_progress(http_url: str) -> float:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.findall(r'^pagedserve_tenant_requests_in_progress\{tenant="default"\} (\S+)$', text, re.M)
    return float(found[0]) if found else 0.0


def test_ctrl_c_with_a_request_in_progress_prints_what_it_waits_for(serve: Serve) -> None:
    (child,) = serve.child_pids()
    os.kill(child, signal.SIGSTOP)
    codes: list[grpc.StatusCode] = []

    def call() -> None:
        try:
            with GenerationClient(serve.grpc_address, timeout=60, retry=NO_RETRY) as client:
                client.generate([5, 6, 7], max_tokens=4)
        except grpc.RpcError as exc:
            codes.append(exc.code())

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_until(lambda: requests_in_progress(serve.http_url) == 1, 30, "the request in progress")
    os.kill(serve.proc.pid, signal.SIGINT)
    line = serve.wait_for(r"pagedserve: stopping: .*", timeout_s=30).group(0)
    os.kill(child, signal.SIGCONT)
    assert line == stopping_line(1, GRACE_S, can_hurry=True)
    assert line == (
        f"pagedserve: stopping: waiting up to {GRACE_S:g} s for 1 request in progress to finish "
        "(new ones are refused); Ctrl-C again (or a second SIGTERM) stops at once"
    )
    assert serve.exit_code(timeout_s=GRACE_S + 30) == 0
    caller.join(30)
    # Finished within the grace once the child ran again, or cut when the grace was over.
    assert not caller.is_alive() and codes in ([], [grpc.StatusCode.UNAVAILABLE])
    assert serve.stdout.count("pagedserve: stopping:") == 1
    assert not any(noise in serve.stderr for noise in LOG_NOISE), serve.stderr[-3000:]


def test_the_line_for_an_idle_server_and_for_several_requests() -> None:
    assert stopping_line(0, 30.0, can_hurry=True) == (
        "pagedserve: stopping: no requests in progress; Ctrl-C again (or a second SIGTERM) stops at once"
    )
    assert stopping_line(3, 30.0, can_hurry=False) == (
        "pagedserve: stopping: waiting up to 30 s for 3 requests in progress to finish (new ones are refused)"
    )
