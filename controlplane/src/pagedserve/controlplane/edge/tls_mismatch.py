"""A plaintext client on the HTTP port when that port speaks TLS: one log line that names the
mismatch, instead of asyncio's silence (a failed TLS handshake is an `ssl.SSLError`, an
`OSError`, which asyncio logs only in debug mode).

How it is seen: the HTTP port's listening socket is a `TLSListener`, whose accepted
connections look at the first bytes they read (the bytes the TLS layer is about to parse, not
a copy, nothing held back). Every TLS connection opens with a handshake record (first byte
0x16); anything else cannot become a TLS session, and OpenSSL refuses it
(`HTTP_REQUEST` / `WRONG_VERSION_NUMBER`) right after. The line is rate-limited
(`MismatchLog`) so a scanner cannot flood the log.

The gRPC port cannot do the same: grpcio's core accepts and handshakes its connections in C
on a socket it binds itself (no Python hook, no way to hand it our socket), and logs a failed
handshake only at its own INFO verbosity, unstructured on stderr.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.log import get_logger

log = get_logger(__name__)

TLS_HANDSHAKE_RECORD = 0x16
"""The first byte of a TLS record carrying a handshake message: every TLS ClientHello's."""
WINDOW_S = 10.0
MAX_LINES_PER_WINDOW = 20
HINT = "the port speaks TLS; the client connected in plaintext (use https:// and the server's CA)"

_HTTP_REQUEST = re.compile(rb"^([A-Z]{3,10}) ")
_FIRST_BYTES = 16  # enough to tell an HTTP request from anything else


def describe(first: bytes) -> str:
    """What a connection's first bytes are, when they are not TLS: a few words for the log."""
    if first.startswith(b"PRI * HTTP/2.0"):
        return "a plaintext HTTP/2 connection preface (h2c, or gRPC without TLS)"
    match = _HTTP_REQUEST.match(first)
    if match is not None:
        return f"a plaintext HTTP request ({match.group(1).decode()})"
    return f"{len(first)}+ bytes that are not a TLS record (first byte 0x{first[0]:02x})"


class MismatchLog:
    """`tls_handshake_failed` lines, rate-limited: at most one per peer host per `window_s`,
    and at most `max_lines` in all per window (a scan from many addresses stays bounded too);
    what was held back is counted on the next line (`suppressed`)."""

    def __init__(
        self,
        port: str = "http",
        window_s: float = WINDOW_S,
        max_lines: int = MAX_LINES_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.port = port
        self.window_s = window_s
        self.max_lines = max_lines
        self._clock = clock
        self._last: dict[str, float] = {}  # peer host -> when its last line was logged
        self._window_start = float("-inf")
        self._lines = 0
        self._suppressed = 0

    def first_bytes(self, peer: Any, first: bytes) -> None:
        """A connection from `peer` read `first` first: logs when that is not TLS (rate-limited)."""
        if first and first[0] != TLS_HANDSHAKE_RECORD:
            self.report(peer, describe(first))

    def report(self, peer: Any, received: str) -> bool:
        """Log the mismatch for `peer` unless rate-limited; True when a line was written."""
        now = self._clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._lines = now, 0
            self._last = {h: t for h, t in self._last.items() if now - t < self.window_s}
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        last = self._last.get(host)
        if (last is not None and now - last < self.window_s) or self._lines >= self.max_lines:
            self._suppressed += 1
            return False
        self._last[host] = now
        self._lines += 1
        suppressed, self._suppressed = self._suppressed, 0
        address = f"{host}:{peer[1]}" if isinstance(peer, tuple) and len(peer) > 1 else host
        log.warning(
            "tls_handshake_failed",
            port=self.port,
            peer=address,
            received=received,
            hint=HINT,
            suppressed=suppressed,
        )
        return True


class _CheckedConnection(socket.socket):
    """An accepted connection that hands its first bytes to `check` (once), then reads as usual."""

    check: Callable[[bytes], None] | None = None

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        n = super().recv_into(buffer, nbytes, flags)
        if self.check is not None and n:
            check, self.check = self.check, None
            check(bytes(memoryview(buffer)[: min(n, _FIRST_BYTES)]))
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if self.check is not None and data:
            check, self.check = self.check, None
            check(data[:_FIRST_BYTES])
        return data


class TLSListener(socket.socket):
    """A listening socket whose accepted connections report their first bytes to `mismatch`
    (set it before serving): what the event loop accepts through `accept()` and reads through
    `recv_into`/`recv` on the connection, with asyncio's own selector loop."""

    mismatch: MismatchLog | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        # socket.socket.accept, with our connection class
        fd, addr = self._accept()  # type: ignore[attr-defined]
        conn = _CheckedConnection(self.family, self.type, self.proto, fileno=fd)
        if socket.getdefaulttimeout() is None and self.gettimeout():
            conn.setblocking(True)
        mismatch = self.mismatch
        if mismatch is not None:
            conn.check = lambda first: mismatch.first_bytes(addr, first)
        return conn, addr
