"""The prefix index follows snapshots and KV events; a sequence gap marks it stale."""

from __future__ import annotations

from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.protos.pagedserve.v1 import dataplane_pb2


def stored(seq: int, *hashes: bytes) -> dataplane_pb2.KVEvent:
    return dataplane_pb2.KVEvent(seq=seq, stored=dataplane_pb2.BlockStoredEvent(block_hashes=list(hashes)))


def removed(seq: int, *hashes: bytes) -> dataplane_pb2.KVEvent:
    return dataplane_pb2.KVEvent(seq=seq, removed=dataplane_pb2.BlockRemovedEvent(block_hashes=list(hashes)))


def test_leading_run_of_cached_hashes() -> None:
    index = PrefixIndex()
    index.load_snapshot("a", [b"h1", b"h2", b"h4"], seq=3)
    assert index.cached_prefix_blocks("a", [b"h1", b"h2", b"h3", b"h4"]) == 2
    assert index.cached_prefix_blocks("a", [b"h9", b"h1"]) == 0
    assert index.cached_prefix_blocks("unknown", [b"h1"]) == 0


def test_events_apply_in_order_and_old_ones_are_skipped() -> None:
    index = PrefixIndex()
    index.load_snapshot("a", [b"h1"], seq=5)
    assert index.apply_events("a", [stored(4, b"old"), stored(6, b"h2", b"h3"), removed(7, b"h1")])
    assert index.cached_prefix_blocks("a", [b"h2", b"h3"]) == 2
    assert index.cached_prefix_blocks("a", [b"h1"]) == 0
    assert index.cached_prefix_blocks("a", [b"old"]) == 0  # seq 4 was already in the snapshot
    cleared = dataplane_pb2.KVEvent(seq=8, cleared=dataplane_pb2.AllBlocksClearedEvent())
    assert index.apply_events("a", [cleared])
    assert index.num_blocks("a") == 0


def test_a_gap_marks_the_entry_stale_until_the_next_snapshot() -> None:
    index = PrefixIndex()
    index.load_snapshot("a", [], seq=1)
    assert not index.apply_events("a", [stored(3, b"h")])
    assert "a" in index.stale
    index.load_snapshot("a", [b"h"], seq=3)
    assert "a" not in index.stale
    assert index.cached_prefix_blocks("a", [b"h"]) == 1


def test_drop_forgets_a_data_plane() -> None:
    index = PrefixIndex()
    index.load_snapshot("a", [b"h"], seq=1)
    index.drop("a")
    assert index.cached_prefix_blocks("a", [b"h"]) == 0
    assert not index.apply_events("a", [stored(2, b"x")])
