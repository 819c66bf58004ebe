"""Request deadlines on the data plane: which requests are past theirs. Imports no torch.

A submit may carry its time left (`SubmitCommand.timeout_ms`); the engine loop adds its arrival
instant plus that here and, before every step, drops what `expired` returns through the
engine's abort path (dataplane/src/pagedserve/dataplane/server/engine_loop.py), so no work past a deadline is scheduled
again whether the request waits, runs or is swapped out. The data plane's own clock
(`time.monotonic`) is the only one involved: the control plane sends a duration, not an instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# A stale heap entry (its request finished or was aborted first) stays until its instant comes;
# past this many of them per live one the heap is rebuilt, so that requests that end long
# before a generous deadline cannot grow it without bound.
_STALE_PER_LIVE = 2
_MIN_REBUILD = 64


class Deadlines(Generic[K]):
    """Keys with a deadline (a `time.monotonic()` instant), soonest first."""

    def __init__(self) -> None:
        self._live: dict[K, tuple[float, int]] = {}  # key -> (instant, the entry's sequence number)
        self._heap: list[tuple[float, int, K]] = []  # (instant, sequence number, key): keys never compared
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def add(self, key: K, at: float) -> None:
        """Give `key` the deadline `at` (replacing one it had)."""
        entry = (at, next(self._seq))
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))

    def discard(self, key: K) -> None:
        """Forget `key`'s deadline (its request ended otherwise); nothing if it had none."""
        if self._live.pop(key, None) is not None and len(self._heap) > max(
            _MIN_REBUILD, _STALE_PER_LIVE * len(self._live)
        ):
            self._heap = [(at, seq, k) for k, (at, seq) in self._live.items()]
            heapq.heapify(self._heap)

    def expired(self, now: float) -> list[K]:
        """The keys whose deadline is at or before `now`, soonest first; they are forgotten."""
        out: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            at, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) == (at, seq):
                del self._live[key]
                out.append(key)
        return out

    def next_deadline(self) -> float | None:
        """The soonest live deadline, or None when no key has one."""
        while self._heap:
            at, seq, key = self._heap[0]
            if self._live.get(key) == (at, seq):
                return at
            heapq.heappop(self._heap)
        return None
