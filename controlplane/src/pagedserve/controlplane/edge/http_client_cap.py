"""A cap on the HTTP connections one client address holds open at once.

The header timeout (http_head_timeout.py) bounds how long a connection may idle without a
request head, but not how many one client may open: 1,000 connections from one address
held 1,000 file descriptors of the control plane, and the fd budget is shared by every
client and by the links to the data planes. Here each connection counts against its peer's
address while it is open; one beyond `--http-max-connections-per-client` is closed as soon
as it is accepted (as nginx's `limit_conn`, at the connection, not per request).

Closed, not answered 429: an answer needs the request head first, and waiting for it (up to
the header timeout) holds the very descriptor the cap protects; an answer written before the
request arrives is lost to a reset when the client's request then reaches a closed socket.
A client at its cap keeps its open connections, so a pooling client (keep-alive) sees only
the extra ones refused. Each refusal counts in `pagedserve_http_connections_refused_total`
and logs `http_connection_refused`, at most once per address per `window_s` (a flood stays
a few lines; what was held back is counted on the next line).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.log import get_logger
from pagedserve.controlplane.edge.http_head_timeout import HeadTimeoutProtocol

log = get_logger(__name__)

WINDOW_S = 10.0


class ClientConnections:
    """Open connections per client address, against `limit` (0: no cap, nothing counted).
    Used from the event loop's thread only."""

    def __init__(
        self,
        limit: int,
        on_refused: Callable[[], None] | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._on_refused = on_refused
        self._window_s = window_s
        self._clock = clock
        self._open: dict[str, int] = {}
        self._logged: dict[str, float] = {}  # address -> when its last line was written
        self._suppressed = 0

    def open(self, host: str) -> int:
        return self._open.get(host, 0)

    def admit(self, host: str) -> bool:
        """Count a new connection from `host`; False (and counted as refused) at the cap."""
        if self.limit <= 0:
            return True
        count = self._open.get(host, 0)
        if count >= self.limit:
            if self._on_refused is not None:
                self._on_refused()
            self._log(host)
            return False
        self._open[host] = count + 1
        return True

    def release(self, host: str) -> None:
        """A connection `admit` counted has closed."""
        count = self._open.get(host, 0) - 1
        if count > 0:
            self._open[host] = count
        else:
            self._open.pop(host, None)

    def _log(self, host: str) -> None:
        now = self._clock()
        last = self._logged.get(host)
        if last is not None and now - last < self._window_s:
            self._suppressed += 1
            return
        # forget addresses that have been quiet for a window: the table stays as small as a flood's
        self._logged = {h: t for h, t in self._logged.items() if now - t < self._window_s}
        self._logged[host] = now
        suppressed, self._suppressed = self._suppressed, 0
        log.warning(
            "http_connection_refused",
            client=host,
            open=self._open.get(host, 0),
            limit=self.limit,
            hint="the client holds --http-max-connections-per-client connections already",
            suppressed=suppressed,
        )


class CappedProtocol(HeadTimeoutProtocol):
    """The header-timeout protocol, each connection counted against its client's cap (see
    module doc). Built through `configured` (uvicorn builds one instance per connection)."""

    clients: ClientConnections | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counted: str | None = None  # the address this connection counts against

    @classmethod
    def configured(cls, head_timeout_s: float, clients: ClientConnections) -> type[CappedProtocol]:
        return type(cls.__name__, (cls,), {"head_timeout_s": head_timeout_s, "clients": clients})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # (uvicorn's bookkeeping, which connection_lost undoes)
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if self.clients is None or host is None:
            return
        if self.clients.admit(host):
            self._counted = host
        else:
            self._disarm()
            transport.close()  # nothing to flush: the client has been sent nothing

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted is not None and self.clients is not None:
            self.clients.release(self._counted)
            self._counted = None
        super().connection_lost(exc)
