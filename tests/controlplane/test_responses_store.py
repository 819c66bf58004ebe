"""The Responses API's store: bounded by entries and bytes whatever is stored, least recently
used evicted first, expired after its TTL (an injected clock: no sleeping), keyed per tenant."""

from __future__ import annotations

import tracemalloc
from typing import Any

from pagedserve.controlplane.responses.store import ResponseStore, entry_size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(i: int, text: str = "x" * 100) -> dict[str, Any]:
    return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"text": text}]}]}


def conversation(text: str = "hello") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_ten_thousand_responses_under_a_small_byte_cap_keep_the_store_under_it() -> None:
    cap = 256 << 10
    store = ResponseStore(max_entries=100_000, max_bytes=cap, ttl_s=3600)
    for i in range(10_000):
        assert store.put("t", f"resp_{i}", response(i, "é" * (i % 300)), conversation())
        assert store.bytes <= cap
    assert 0 < len(store) < 10_000
    kept = [i for i in range(10_000) if store.get("t", f"resp_{i}") is not None]
    assert kept == list(range(10_000 - len(kept), 10_000))  # the newest ones
    total = sum(entry_size(response(i, "é" * (i % 300)), conversation()) for i in kept)
    assert store.bytes == total <= cap


def test_ten_thousand_responses_under_a_16_mb_cap_hold_less_memory_than_the_cap() -> None:
    cap = 16 << 20
    store = ResponseStore(max_entries=100_000, max_bytes=cap, ttl_s=3600)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            store.put(f"tenant-{i % 7}", f"resp_{i:032x}", response(i, "ü" * 1500), conversation("q" * 500))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.bytes <= cap and held <= cap, (store.bytes, held)
    assert len(store) < 10_000  # (the entries outgrew the cap: the oldest went)


def test_the_entry_cap_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_entries=3, max_bytes=1 << 20, ttl_s=3600)
    for i in range(3):
        store.put("t", f"r{i}", response(i), conversation())
    assert store.get("t", "r0") is not None  # r0 is now the most recently used: r1 goes first
    store.put("t", "r3", response(3), conversation())
    assert len(store) == 3
    assert store.get("t", "r1") is None
    assert all(store.get("t", f"r{i}") is not None for i in (0, 2, 3))


def test_an_entry_larger_than_the_cap_is_not_stored_and_evicts_nothing() -> None:
    store = ResponseStore(max_entries=10, max_bytes=2000, ttl_s=3600)
    assert store.put("t", "small", response(0), conversation())
    assert not store.put("t", "huge", response(1, "x" * 5000), conversation())
    assert store.get("t", "huge") is None and store.get("t", "small") is not None


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60, clock=clock)
    store.put("t", "old", response(0), conversation())
    clock.now = 30
    store.put("t", "new", response(1), conversation())
    clock.now = 59.9
    assert store.get("t", "old") is not None  # reading does not extend the TTL
    clock.now = 60
    assert store.get("t", "old") is None
    assert store.get("t", "new") is not None
    clock.now = 100
    store.put("t", "newest", response(2), conversation())  # storing drops what expired
    assert len(store) == 1 and store.get("t", "new") is None
    assert store.bytes == entry_size(response(2), conversation())


def test_another_tenants_id_is_not_found_and_cannot_be_deleted() -> None:
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60)
    store.put("alice", "r1", response(1), conversation())
    assert store.get("bob", "r1") is None and store.get(None, "r1") is None
    assert not store.delete("bob", "r1")
    assert store.get("alice", "r1") is not None
    assert store.delete("alice", "r1") and not store.delete("alice", "r1")
    assert len(store) == 0 and store.bytes == 0


def test_a_store_of_zero_entries_is_disabled() -> None:
    store = ResponseStore(max_entries=0, max_bytes=1 << 20, ttl_s=60)
    assert not store.enabled
    assert not store.put("t", "r", response(0), conversation())
    assert store.get("t", "r") is None
