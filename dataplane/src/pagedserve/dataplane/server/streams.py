"""The connected streams (one per control-plane replica) and what each is owed this iteration.

Every stream gets one `ConnectResponse` per loop iteration that produced anything: its own
deltas, finished and rejected requests, plus the stats and KV events every stream shares.
Messages go through the stream's `Sink`, so the loop never waits on a client.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.protos.pagedserve.v1 import dataplane_pb2

Sink = Callable[[dataplane_pb2.ConnectResponse | None], None]
"""Receives a stream's responses in order; None means the loop is gone (end the stream)."""


@dataclass
class Outbox:
    """One stream's share of an iteration's output."""

    deltas: list[dataplane_pb2.TokenDelta] = field(default_factory=list)
    finished: list[dataplane_pb2.RequestFinished] = field(default_factory=list)
    rejected: list[dataplane_pb2.SubmitRejected] = field(default_factory=list)


class StreamMux:
    """Streams by id, and their outboxes until the next `send`. Loop thread only, except
    `new_id`, which `EngineLoop.connect` calls from a gRPC thread."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._outboxes: dict[str, Outbox] = {}
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return f"s{next(self._ids)}"

    def add(self, stream_id: str, sink: Sink) -> None:
        self._sinks[stream_id] = sink

    def remove(self, stream_id: str) -> bool:
        """Forget a stream and what it was owed; False when it was not connected."""
        self._outboxes.pop(stream_id, None)
        return self._sinks.pop(stream_id, None) is not None

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._sinks

    def __len__(self) -> int:
        return len(self._sinks)

    def outbox(self, stream_id: str) -> Outbox:
        box = self._outboxes.get(stream_id)
        if box is None:
            box = self._outboxes[stream_id] = Outbox()
        return box

    @property
    def has_output(self) -> bool:
        return bool(self._outboxes)

    def send(self, stats: dataplane_pb2.PoolStats, kv_events: list[dataplane_pb2.KVEvent]) -> None:
        """Hand every stream its outbox (maybe empty) with the shared stats and events."""
        for stream_id, sink in self._sinks.items():
            box = self._outboxes.get(stream_id, Outbox())
            sink(
                dataplane_pb2.ConnectResponse(
                    deltas=box.deltas,
                    finished=box.finished,
                    rejected=box.rejected,
                    stats=stats,
                    kv_events=kv_events,
                )
            )
        self._outboxes.clear()

    def close_all(self) -> None:
        """Tell every stream the loop is gone."""
        for sink in self._sinks.values():
            sink(None)
