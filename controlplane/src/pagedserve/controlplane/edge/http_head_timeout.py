"""A deadline for every HTTP request head.

uvicorn's h11 protocol never times out a request head: a connection that sends nothing, or
half a head a byte at a time (slowloris), or stops midway through the next head after a
response (its keep-alive timer is cancelled by the first byte), stays open for ever and holds
a file descriptor. 1,000 such connections held 1,000 descriptors of the control plane. Here a
connection whose request head is not complete `head_timeout_s` after it opened, or after the
previous response ended, is closed (as nginx's `client_header_timeout` and Go's
`ReadHeaderTimeout` do). A head that completes in time is served as before; a body that a
client trickles is the application's to bound (the request body limit).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.common.log import get_logger

log = get_logger(__name__)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, each request head due within `head_timeout_s` (see module doc).
    Built through `with_timeout`: the seconds come from the settings (`--http-header-timeout`)."""

    head_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, seconds: float) -> type[HeadTimeoutProtocol]:
        """This protocol with its own deadline (uvicorn builds one instance per connection)."""
        return type(cls.__name__, (cls,), {"head_timeout_s": seconds})

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            log.info("http_head_timeout", client=self.client, timeout_s=self.head_timeout_s)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_head():
            self._disarm()  # the head is in: the request is served as long as it takes

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next head on this connection is due in time too
        super().on_response_complete()  # may start a pipelined request (handle_events disarms)
