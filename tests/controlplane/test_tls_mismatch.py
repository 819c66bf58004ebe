"""The plaintext-client-on-a-TLS-port line: what it says about the first bytes, and its rate limit."""

from __future__ import annotations

import socket

import pytest

from pagedserve.controlplane.edge import tls_mismatch
from pagedserve.controlplane.edge.tls_mismatch import MismatchLog, TLSListener, describe


def test_describe_names_what_came_instead_of_tls() -> None:
    assert describe(b"GET /health HTTP") == "a plaintext HTTP request (GET)"
    assert describe(b"POST /v1/complet") == "a plaintext HTTP request (POST)"
    assert "HTTP/2" in describe(b"PRI * HTTP/2.0\r\n\r\n")
    assert "0x00" in describe(b"\x00\x01")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    seen: list[dict[str, object]] = []

    class Log:
        def warning(self, event: str, **fields: object) -> None:
            seen.append({"event": event, **fields})

    monkeypatch.setattr(tls_mismatch, "log", Log())
    return seen


def test_one_line_per_peer_per_window_and_a_bounded_total(lines: list[dict[str, object]]) -> None:
    clock = Clock()
    log = MismatchLog("http", window_s=10.0, max_lines=3, clock=clock)
    log.first_bytes(("10.0.0.1", 40000), b"\x16\x03\x01")  # TLS: nothing to say
    assert lines == []
    for port in range(5):  # one peer, five plaintext connections: one line
        log.first_bytes(("10.0.0.1", 40001 + port), b"GET / HTTP/1.1")
    assert len(lines) == 1
    assert lines[0]["event"] == "tls_handshake_failed" and lines[0]["peer"] == "10.0.0.1:40001"
    assert "speaks TLS" in str(lines[0]["hint"]) and "https://" in str(lines[0]["hint"])
    assert lines[0]["received"] == "a plaintext HTTP request (GET)"
    for host in range(2, 12):  # a scan from ten addresses: two more lines, then silence
        log.first_bytes((f"10.0.0.{host}", 1), b"GET / HTTP/1.1")
    assert len(lines) == 3 and lines[1]["suppressed"] == 4  # the first peer's four repeats
    clock.now = 10.0  # a new window: the first peer again, with the count held back
    log.first_bytes(("10.0.0.1", 40100), b"GET / HTTP/1.1")
    assert len(lines) == 4 and lines[-1]["suppressed"] == 8


def test_the_listener_hands_the_first_bytes_over_once(lines: list[dict[str, object]]) -> None:
    with TLSListener(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.mismatch = MismatchLog("http")
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            conn, _ = listener.accept()
            with conn:
                client.sendall(b"GET /health HTTP/1.1\r\n\r\n")
                buf = bytearray(8)
                assert conn.recv_into(buf) == 8 and bytes(buf) == b"GET /hea"
                assert conn.recv(100) == b"lth HTTP/1.1\r\n\r\n"  # the rest, unchanged
    assert [line["received"] for line in lines] == ["a plaintext HTTP request (GET)"]
