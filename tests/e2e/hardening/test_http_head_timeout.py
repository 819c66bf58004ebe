"""Half-open HTTP connections are closed: a request head not complete within the header timeout
(`--http-header-timeout`) ends its connection, whether the client sent nothing, half a head, or
half of its next head after a response; a head sent in time is served as before. Against a
real control plane and data plane on a tiny model."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from tests.e2e.harness import ServerThread, engine_config

HEAD_TIMEOUT_S = 1.0
GUARD_S = 30.0  # a hang guard only: the close is awaited, not timed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(tiny), tiny, http_header_timeout_s=HEAD_TIMEOUT_S)
    yield srv
    srv.close()


def connect(server: ServerThread) -> socket.socket:
    host, port = server.http_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GUARD_S)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes the connection (b"" at EOF); True when it did."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
    return False


def test_a_connection_that_sends_nothing_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        assert closed_by_server(sock)


def test_half_a_head_sent_slowly_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        for piece in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n"):
            sock.sendall(piece)  # each byte run resets nothing: the head has one deadline
            time.sleep(HEAD_TIMEOUT_S / 4)
        assert closed_by_server(sock)
        assert time.monotonic() - started >= HEAD_TIMEOUT_S  # not before its deadline


def test_a_head_in_time_is_served_and_the_next_half_head_is_closed(server: ServerThread) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next head, never finished
        assert closed_by_server(sock)


def test_the_server_keeps_serving(server: ServerThread) -> None:
    held = [connect(server) for _ in range(20)]  # idle connections, closed by the server in time
    try:
        assert all(closed_by_server(sock) for sock in held)
    finally:
        for sock in held:
            sock.close()
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200")
