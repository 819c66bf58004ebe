"""Submits that reached the engine loop but are not in the engine yet, in arrival order.

Taking a submit in costs the engine thread real work (its sampling parameters parsed and
checked, the request and its samples built, its prompt's blocks hashed for the prefix
cache). A burst of 1,000 submits on one stream, applied all at once between two steps, held
every running stream for that long (19.3 s in the issue, 0.25 s with a tiny model here). So
the loop takes at most `MAX_SUBMITS_PER_STEP` of them per iteration; the rest wait here, a
cost spread over steps, charged to the burst (its requests start a few steps later) rather
than to everyone's next token. Loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.dataplane.server.groups import StreamRequestKey
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

MAX_SUBMITS_PER_STEP = 32
"""Submits taken into the engine per loop iteration: about 10 ms of the engine thread at
most, and more per step than a step's batch could start anyway (max_num_seqs and the
token budget bound it)."""


@dataclass(frozen=True)
class Arrival:
    key: StreamRequestKey
    command: dataplane_pb2.SubmitCommand
    received: float  # when the submit reached the data plane: its deadline counts from here


class Arrivals:
    def __init__(self) -> None:
        self._pending: dict[StreamRequestKey, Arrival] = {}  # insertion order: arrival order

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pending

    def add(self, arrival: Arrival) -> None:
        self._pending[arrival.key] = arrival

    def discard(self, key: StreamRequestKey) -> bool:
        """Forget `key`'s submit (aborted before it was taken in); False when none waits."""
        return self._pending.pop(key, None) is not None

    def discard_stream(self, stream_id: str) -> int:
        """Forget every submit of a closed stream; how many there were."""
        keys = [key for key in self._pending if key.stream_id == stream_id]
        for key in keys:
            del self._pending[key]
        return len(keys)

    def take(self, limit: int = MAX_SUBMITS_PER_STEP) -> list[Arrival]:
        """The oldest `limit` submits, removed from here."""
        taken: list[Arrival] = []
        for key in list(self._pending)[:limit]:
            taken.append(self._pending.pop(key))
        return taken
