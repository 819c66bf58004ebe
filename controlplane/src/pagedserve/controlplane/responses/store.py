"""The Responses API's store: responses created with `store: true`, kept in memory so that
`previous_response_id`, `GET` and `DELETE /v1/responses/{id}` can find them.

Bounded three ways, whatever clients send: at most `max_entries` responses, at most
`max_bytes` of them in all, each kept at most `ttl_s` after it was stored. An entry is kept as
the UTF-8 bytes of its JSON (the response object, the conversation kept to continue it and
its input items),
parsed again when read, so what it counts for (those bytes plus ENTRY_OVERHEAD for its keys and
bookkeeping) bounds the memory it holds. A
new entry first drops the expired ones, then the least recently used (stored or read) until it
fits; one larger than `max_bytes` alone is not stored. Entries are keyed by (tenant, id): one
API key's tenant never reads, continues or deletes another's response (it is not there for
it: 404). The store lives in the control plane's memory: a restart forgets every response,
and each control-plane replica has its own.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENTRY_OVERHEAD = 768
"""Bytes an entry counts for beyond its JSON: its key, its record and the two index nodes."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One kept response: its JSON, and when it was stored."""

    blob: bytes
    stored_at: float

    @property
    def size(self) -> int:
        return len(self.blob) + ENTRY_OVERHEAD

    @property
    def response(self) -> dict[str, Any]:
        """The response object, as `GET` returns it."""
        return json.loads(self.blob)[0]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages that led to it, its own output last (for a request continuing it)."""
        return json.loads(self.blob)[1]

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """Its request's input items (input_items.py), as `GET .../input_items` lists them."""
        return json.loads(self.blob)[2]


def _blob(response: dict[str, Any], conversation: list[dict[str, Any]], items: list[dict[str, Any]]) -> bytes:
    return json.dumps([response, conversation, items], ensure_ascii=False).encode("utf-8", "replace")


def entry_size(
    response: dict[str, Any], conversation: list[dict[str, Any]], items: list[dict[str, Any]] | None = None
) -> int:
    """The bytes an entry counts for."""
    return len(_blob(response, conversation, items or [])) + ENTRY_OVERHEAD


class ResponseStore:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_entries` 0 disables the store (nothing is stored, nothing found)."""
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # in use order
        self._by_age: OrderedDict[tuple[str, str], None] = OrderedDict()  # in storing order
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        tenant: str | None,
        response_id: str,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Store a response (replacing one of the same id) with the conversation that continues
        it and its input `items`, evicting expired then least recently used entries until it
        fits; False (nothing stored) when it cannot fit at all."""
        blob = _blob(response, conversation, items or [])
        size = len(blob) + ENTRY_OVERHEAD
        key = (tenant or "", response_id)
        self._drop(key)
        if not self.enabled or size > self.max_bytes:
            return False
        self._expire()
        while self._entries and (
            len(self._entries) >= self.max_entries or self.bytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        self._entries[key] = StoredResponse(blob, self._clock())
        self._by_age[key] = None
        self.bytes += size
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        """The tenant's stored response of that id (now the most recently used), or None."""
        key = (tenant or "", response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() - entry.stored_at >= self.ttl_s:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def delete(self, tenant: str | None, response_id: str) -> bool:
        """Forget the tenant's response of that id; whether there was one."""
        return self.get(tenant, response_id) is not None and self._drop((tenant or "", response_id))

    def _expire(self) -> None:
        now = self._clock()
        while self._by_age:
            oldest = next(iter(self._by_age))
            if now - self._entries[oldest].stored_at < self.ttl_s:
                return
            self._drop(oldest)

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        del self._by_age[key]
        self.bytes -= entry.size
        return True
