"""The time that deadlines, idle waits, heartbeats and delayed log lines are measured on.

Code that waits for time to pass takes a `Clock` (the system's by default), so its tests can
pass one they advance by hand (tests/clock.py) and assert exact instants instead of sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (the origin means nothing)."""
        ...

    async def sleep(self, delay: float) -> None:
        """Like `asyncio.sleep`: return once `delay` seconds of this clock have passed."""
        ...

    def timeout(self, delay: float | None) -> AbstractAsyncContextManager[object]:
        """Like `asyncio.timeout`: the block raises TimeoutError once `delay` seconds of this
        clock have passed (None: never)."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """Call `callback` on the running event loop once `delay` seconds of this clock have
        passed; RuntimeError when no event loop is running."""
        ...


class SystemClock:
    """The clock of the machine and of the running asyncio event loop."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, delay: float) -> None:
        await asyncio.sleep(delay)

    def timeout(self, delay: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(delay)

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(delay, callback)


SYSTEM_CLOCK: Clock = SystemClock()
