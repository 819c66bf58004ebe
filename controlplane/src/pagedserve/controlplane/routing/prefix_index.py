"""Which data plane caches which KV blocks, built only from their snapshots and KV events.

Each data plane's entry is the set of chained block hashes its pool holds. A snapshot
replaces the set (as of its event sequence number); events after it apply in order. A gap in
the sequence means a lost message: the entry is marked stale and the caller resyncs with
GetState. Because block hashes are chained, a prompt's cached prefix on a data plane is the
run of its leading hashes found in that set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedserve.protos.pagedserve.v1 import dataplane_pb2


class PrefixIndex:
    def __init__(self) -> None:
        self._hashes: dict[str, set[bytes]] = {}
        self._seq: dict[str, int] = {}
        self.stale: set[str] = set()

    def load_snapshot(self, dataplane: str, block_hashes: Iterable[bytes], seq: int) -> None:
        self._hashes[dataplane] = set(block_hashes)
        self._seq[dataplane] = seq
        self.stale.discard(dataplane)

    def apply_events(self, dataplane: str, events: Sequence[dataplane_pb2.KVEvent]) -> bool:
        """Apply events in order; False (and the entry marked stale) on a sequence gap."""
        hashes = self._hashes.get(dataplane)
        if hashes is None:
            return False
        for event in events:
            seq = self._seq[dataplane]
            if event.seq <= seq:
                continue  # already reflected by the snapshot
            if event.seq != seq + 1:
                self.stale.add(dataplane)
                return False
            kind = event.WhichOneof("event")
            if kind == "stored":
                hashes.update(event.stored.block_hashes)
            elif kind == "removed":
                hashes.difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                hashes.clear()
            self._seq[dataplane] = event.seq
        return True

    def drop(self, dataplane: str) -> None:
        self._hashes.pop(dataplane, None)
        self._seq.pop(dataplane, None)
        self.stale.discard(dataplane)

    def cached_prefix_blocks(self, dataplane: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the data plane holds."""
        hashes = self._hashes.get(dataplane)
        if not hashes:
            return 0
        count = 0
        for h in block_hashes:
            if h not in hashes:
                break
            count += 1
        return count

    def num_blocks(self, dataplane: str) -> int:
        return len(self._hashes.get(dataplane, ()))
