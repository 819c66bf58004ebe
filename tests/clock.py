"""A clock that moves only when a test advances it (`pagedserve.common.clock.Clock`).

Timers (`call_later`, `timeout`, `sleep`) fire inside `advance`, in the order of their
instants, each seeing `monotonic()` read its own instant. A timeout that fires cancels its task
on the event loop as `asyncio.timeout` does: the task sees TimeoutError once it next runs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from types import TracebackType


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self.now + max(0.0, delay), next(self._seq), callback))

    def timeout(self, delay: float | None) -> FakeTimeout:
        return FakeTimeout(self, delay)

    async def sleep(self, delay: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        self.call_later(delay, lambda: None if woken.done() else woken.set_result(None))
        await woken

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass, firing every timer due by then."""
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            at, _, callback = heapq.heappop(self._timers)
            self.now = max(self.now, at)
            callback()
        self.now = end

    @property
    def pending(self) -> int:
        """Timers not fired yet (those of exited timeouts included)."""
        return len(self._timers)


class FakeTimeout:
    """`asyncio.timeout(delay)` on a `FakeClock`: a never-expiring asyncio timeout that the
    clock makes expire when `delay` of its seconds have passed."""

    def __init__(self, clock: FakeClock, delay: float | None) -> None:
        self._clock = clock
        self._delay = delay
        self._inner = asyncio.timeout(None)
        self._open = False

    async def __aenter__(self) -> FakeTimeout:
        await self._inner.__aenter__()
        self._open = True
        if self._delay is not None:
            if self._delay <= 0:
                self._expire()
            else:
                self._clock.call_later(self._delay, self._expire)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._open = False
        await self._inner.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired
        return None

    def _expire(self) -> None:
        if self._open and self._inner.when() is None:
            self._inner.reschedule(asyncio.get_running_loop().time())
