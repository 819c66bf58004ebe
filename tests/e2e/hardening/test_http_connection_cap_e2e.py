"""One client cannot hold more than `--http-max-connections-per-client` HTTP connections: the
ones beyond the cap are closed as soon as they are accepted (long before the header timeout),
the first ones stay usable, closing some lets new ones in, and
`pagedserve_http_connections_refused_total` counts every refusal. Against a real control
plane and data plane on a tiny model; every connection comes from 127.0.0.1."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from tests.e2e.harness import ServerThread, engine_config

CAP = 4
EXTRA = 3
HEAD_TIMEOUT_S = 300.0  # far beyond GUARD_S: a close seen here is the cap's, not the timeout's
GUARD_S = 30.0  # a hang guard only: closes and replies are awaited, not timed
REFUSED = re.compile(rb"^pagedserve_http_connections_refused_total (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(
        engine_config(tiny),
        tiny,
        http_header_timeout_s=HEAD_TIMEOUT_S,
        http_max_connections_per_client=CAP,
    )
    yield srv
    srv.close()


def connect(server: ServerThread) -> socket.socket:
    host, port = server.http_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=GUARD_S)


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


def get(sock: socket.socket, path: str) -> tuple[int, bytes] | None:
    """One keep-alive GET on `sock`: (status, body), or None when the server closed it."""
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            body += chunk
        return int(head.split(b" ", 2)[1]), body
    except (ConnectionResetError, BrokenPipeError):
        return None


def refused_total(sock: socket.socket) -> float:
    reply = get(sock, "/metrics")
    assert reply is not None and reply[0] == 200
    match = REFUSED.search(reply[1])
    assert match is not None
    return float(match.group(1))


def test_connections_beyond_the_cap_are_closed_and_a_closed_one_frees_a_slot(server: ServerThread) -> None:
    held = [connect(server) for _ in range(CAP)]  # idle: the header timeout is far off
    try:
        # (the extras queue behind these in the listening socket: they are accepted after them)
        before = refused_total(held[0])
        extra = [connect(server) for _ in range(EXTRA)]
        try:
            assert all(closed_by_server(sock) for sock in extra)
        finally:
            for sock in extra:
                sock.close()
        for sock in held:  # the first CAP stay usable
            reply = get(sock, "/health")
            assert reply is not None and reply[0] == 200
        assert refused_total(held[0]) == before + EXTRA

        for sock in held[-2:]:  # closing two frees two slots
            sock.close()
        del held[-2:]
        retries = 0  # (the server may see a new connection before it sees an old one's close)
        deadline = time.monotonic() + GUARD_S
        while len(held) < CAP and time.monotonic() < deadline:
            sock = connect(server)
            reply = get(sock, "/health")
            if reply is not None and reply[0] == 200:
                held.append(sock)
            else:
                sock.close()
                retries += 1
                time.sleep(0.05)
        assert len(held) == CAP
        with connect(server) as one_more:  # and the cap holds again
            assert closed_by_server(one_more)
        # (on the newest connection: an older one may have idled past uvicorn's keep-alive)
        assert refused_total(held[-1]) == before + EXTRA + retries + 1
    finally:
        for sock in held:
            sock.close()
