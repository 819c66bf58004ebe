"""`serve` stopped with streams open never waits on its clients (real processes, the default model).

SIGTERM with an SSE stream (/v1/completions) and a gRPC Generate stream open, both far longer
than `--shutdown-grace`: new requests are refused during the grace, then both streams are cut
(the SSE stream's last event is an OpenAI error naming the shutdown, the gRPC stream ends
UNAVAILABLE), and `serve` and its data plane are gone. A second SIGINT soon after the first
cuts at once: with a 60 s grace, everything is gone within seconds. Beneath those: the HTTP
port's stop closes a response whose client reads nothing, and the stop deadline holds even
with the event loop blocked (the watchdog thread of `StopSignals`).

The assertions are on events (a chunk received, a process gone); the only wall-clock bounds
are generous upper ones (a loaded two-core machine), and one lower one: the cut never comes
before the grace is over.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pagedserve.clients.python import GenerationClient, StreamChunk
from pagedserve.clients.python.retry import NO_RETRY
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.controlplane.edge.http_server import HttpServer
from tests.e2e.harness import REPO, wait_until
from tests.e2e.lifecycle.test_process_lifecycle import LOG_NOISE, Proc, gone, http_status

MAX_TOKENS = 4000  # with ignore_eos: a minute or more on a CPU, far past every grace here
SLACK_S = 15.0  # on top of what the server promises (grace + 2 s; 1 s after a second signal)
PROMPT = "Once upon a time"


@dataclass
class Server:
    proc: Proc
    grpc_address: str
    http_url: str
    tree: list[psutil.Process]  # serve and its descendants, recorded while serving


@pytest.fixture
def start_serve(default_model_path: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[Proc] = []

    def start(grace_s: float) -> Server:
        argv = ["serve", "--grpc-port", "0", "--http-port", "0", "--threads", "1"]
        proc = Proc([*argv, "--shutdown-grace", f"{grace_s:g}"], tmp_path, f"serve-{len(started)}")
        started.append(proc)
        line = proc.wait_for(r"gRPC on (\S+)  HTTP on (\S+)")
        root = psutil.Process(proc.proc.pid)
        tree = [root, *root.children(recursive=True)]
        assert len(tree) >= 2, "serve runs its data plane as a child"
        return Server(proc, line.group(1), line.group(2), tree)

    yield start
    for proc in started:
        proc.cleanup()


@dataclass
class SseStream:
    """A streaming /v1/completions request read in a thread, event by event."""

    url: str
    events: list[Any] = field(default_factory=list)  # parsed `data:` payloads; "[DONE]" as is
    streaming: threading.Event = field(default_factory=threading.Event)  # a token arrived
    error_at: float | None = None  # monotonic time the error event arrived
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            parts = urllib.parse.urlsplit(self.url)
            conn = http.client.HTTPConnection(parts.netloc, timeout=60)
            body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
            body |= {"ignore_eos": True, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            while line := response.readline():
                text = line.decode().strip()
                if not text.startswith("data: "):
                    continue
                payload = text.removeprefix("data: ")
                event = payload if payload == "[DONE]" else json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    self.error_at = time.monotonic()
                elif isinstance(event, dict) and event.get("choices"):
                    self.streaming.set()
                self.events.append(event)
            conn.close()
        except BaseException as exc:  # reported by the test
            self.failure = exc

    def assert_cut(self, reason: str) -> None:
        """It streamed, then ended with one OpenAI error event naming the shutdown, then [DONE]."""
        assert self.failure is None, repr(self.failure)
        assert not self.thread.is_alive()
        assert self.events[-1] == "[DONE]", self.events[-3:]
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and self.events[-2] is errors[0], self.events[-3:]
        error = errors[0]["error"]
        assert error["code"] == "unavailable" and error["type"] == "service_unavailable", error
        assert "shutting down" in error["message"] and reason in error["message"], error
        tokens = [e for e in self.events if isinstance(e, dict) and e.get("choices")]
        assert tokens and all(c["finish_reason"] is None for e in tokens for c in e["choices"])


@dataclass
class GrpcStream:
    """A gRPC Generate stream read in a thread; `code`/`details` of the status it ended with."""

    address: str
    streaming: threading.Event = field(default_factory=threading.Event)
    code: grpc.StatusCode | None = None
    details: str = ""
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with GenerationClient(self.address, retry=NO_RETRY) as client:
                for item in client.generate_stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True):
                    if isinstance(item, StreamChunk):
                        self.streaming.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        except BaseException as exc:
            self.failure = exc

    def assert_cut(self, reason: str) -> None:
        assert self.failure is None, repr(self.failure)
        assert self.streaming.is_set()
        assert self.code == grpc.StatusCode.UNAVAILABLE, (self.code, self.details)
        assert "shutting down" in self.details and reason in self.details, self.details


def _streaming_or_ended(stream: SseStream | GrpcStream) -> bool:
    return stream.streaming.is_set() or not stream.thread.is_alive()


def open_streams(server: Server) -> tuple[SseStream, GrpcStream]:
    sse, rpc = SseStream(server.http_url), GrpcStream(server.grpc_address)
    for stream in (sse, rpc):
        wait_until(functools.partial(_streaming_or_ended, stream), 60, "a stream runs")
    assert sse.streaming.is_set(), (sse.failure, sse.events[-3:])
    assert rpc.streaming.is_set(), (rpc.failure, rpc.code, rpc.details)
    return sse, rpc


def wait_all_gone(server: Server, timeout_s: float, sig: int) -> None:
    """serve and every process of its tree exit within `timeout_s` (events, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    code = server.proc.exit_code(timeout_s=timeout_s)
    # 0 from the graceful path; 128 + the signal if the watchdog had to end it at the deadline
    # (a heavily loaded machine): either way it is gone, which is what this checks.
    assert code in (0, 128 + sig), (code, server.proc.stderr[-3000:])
    for process in server.tree[1:]:
        left = max(0.1, deadline - time.monotonic())
        wait_until(functools.partial(gone, process.pid), left, f"pid {process.pid} of serve's tree gone")


@pytest.mark.real_model
def test_sigterm_cuts_the_open_streams_at_the_end_of_the_grace(start_serve: Any) -> None:
    grace_s = 2.0
    server = start_serve(grace_s)
    sse, rpc = open_streams(server)

    server.proc.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # Draining: new work is refused (503) while the open streams go on.
    wait_until(lambda: http_status(f"{server.http_url}/health") == 503, grace_s + SLACK_S, "/health 503")
    if sse.error_at is None:  # (the grace may be over already on a very slow machine)
        body = json.dumps({"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 2})
        parts = urllib.parse.urlsplit(server.http_url)
        conn = http.client.HTTPConnection(parts.netloc, timeout=10)
        try:
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            assert conn.getresponse().status == 503
        except ConnectionError:
            assert sse.error_at is not None  # the ports closed in the meantime: after the cut
        finally:
            conn.close()

    wait_all_gone(server, grace_s + SLACK_S, signal.SIGTERM)
    for stream in (sse, rpc):
        stream.thread.join(SLACK_S)
    reason = f"{grace_s:g} s grace is over"
    sse.assert_cut(reason)
    rpc.assert_cut(reason)
    assert sse.error_at is not None and sse.error_at - signalled >= grace_s - 0.1  # never before the grace
    assert not any(noise in server.proc.stderr for noise in LOG_NOISE), server.proc.stderr[-3000:]


@pytest.mark.real_model
def test_a_second_sigint_exits_at_once(start_serve: Any) -> None:
    grace_s = 60.0
    server = start_serve(grace_s)
    sse, rpc = open_streams(server)

    server.proc.proc.send_signal(signal.SIGINT)
    # "Soon after": once the first one has taken effect (draining), not after a fixed sleep.
    wait_until(lambda: http_status(f"{server.http_url}/health") == 503, SLACK_S, "/health 503")
    server.proc.proc.send_signal(signal.SIGINT)
    second = time.monotonic()

    wait_all_gone(server, SLACK_S, signal.SIGINT)  # well before the 60 s grace
    assert time.monotonic() - second < grace_s / 2
    for stream in (sse, rpc):
        stream.thread.join(SLACK_S)
    sse.assert_cut("second signal")
    rpc.assert_cut("second signal")
    assert not any(noise in server.proc.stderr for noise in LOG_NOISE), server.proc.stderr[-3000:]


def test_the_http_stop_closes_a_response_whose_client_reads_nothing() -> None:
    async def run() -> None:
        app = FastAPI()
        ended = asyncio.Event()

        async def endless() -> Any:
            try:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0)
            finally:
                ended.set()  # the response was closed under the app, its generator too

        @app.get("/endless")
        async def endless_route() -> StreamingResponse:
            return StreamingResponse(endless())

        http = HttpServer(app, "127.0.0.1", 0, None, header_timeout_s=10.0)
        await http.start()
        client = socket.create_connection(("127.0.0.1", http.port))
        try:
            client.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")  # ... and never read
            await asyncio.sleep(0.5)  # the server's send buffers fill up
            await asyncio.wait_for(http.stop(timeout_s=0.5), SLACK_S)
            await asyncio.wait_for(ended.wait(), SLACK_S)
        finally:
            client.close()

    asyncio.run(run())


_BLOCKED = """
import asyncio, sys, time
from pagedserve.common.lifecycle import StopSignals

async def main() -> None:
    signals = StopSignals(float(sys.argv[1]))
    signals.before_hard_exit = lambda: open(sys.argv[2], "w").write("children killed")
    print("ready", flush=True)
    time.sleep(600)  # the event loop is blocked: no coroutine ever sees a signal

asyncio.run(main())
"""


@pytest.mark.parametrize(("signals", "grace_s"), [(1, 0.5), (2, 60.0), (3, 60.0)])
def test_the_stop_deadline_holds_with_the_event_loop_blocked(
    signals: int, grace_s: float, tmp_path: Path
) -> None:
    """One SIGTERM: gone by grace + 2 s; a second: within 1 s; a third: at once. The children
    are killed first (`before_hard_exit`)."""
    flag = tmp_path / "flag"
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED, str(grace_s), str(flag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)  # (separate signals, not one merged pending one)
        code = proc.wait(timeout=grace_s + SLACK_S if signals == 1 else SLACK_S)
        assert code == 128 + signal.SIGTERM  # the watchdog's exit: 128 + the first signal
        assert flag.read_text() == "children killed"
        assert proc.stderr is not None and "not stopped by its deadline" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
