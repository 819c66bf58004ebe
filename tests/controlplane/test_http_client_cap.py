"""The per-client HTTP connection count: admits up to the cap per address, refuses beyond it
(counted, logged at most once per address per window), and frees a slot when a connection
closes. The served behaviour is tests/e2e/hardening/test_http_connection_cap_e2e.py."""

from __future__ import annotations

import pytest

from pagedserve.controlplane.edge import http_client_cap
from pagedserve.controlplane.edge.http_client_cap import ClientConnections


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    seen: list[dict[str, object]] = []

    class Log:
        def warning(self, event: str, **fields: object) -> None:
            seen.append({"event": event, **fields})

    monkeypatch.setattr(http_client_cap, "log", Log())
    return seen


def test_the_cap_is_per_address_and_a_closed_connection_frees_its_slot(
    lines: list[dict[str, object]],
) -> None:
    refused: list[None] = []
    clients = ClientConnections(2, on_refused=lambda: refused.append(None))
    assert clients.admit("10.0.0.1") and clients.admit("10.0.0.1")
    assert not clients.admit("10.0.0.1")
    assert clients.admit("10.0.0.2")  # another address has its own count
    assert len(refused) == 1 and clients.open("10.0.0.1") == 2
    clients.release("10.0.0.1")
    assert clients.admit("10.0.0.1") and not clients.admit("10.0.0.1")
    assert len(refused) == 2
    for _ in range(2):
        clients.release("10.0.0.1")
    clients.release("10.0.0.2")
    assert clients.open("10.0.0.1") == clients.open("10.0.0.2") == 0 and not clients._open


def test_zero_is_no_cap(lines: list[dict[str, object]]) -> None:
    clients = ClientConnections(0)
    assert all(clients.admit("10.0.0.1") for _ in range(1000))
    assert lines == [] and not clients._open  # nothing counted


def test_one_line_per_address_per_window(lines: list[dict[str, object]]) -> None:
    clock = Clock()
    clients = ClientConnections(1, window_s=10.0, clock=clock)
    assert clients.admit("10.0.0.1")
    for _ in range(5):
        assert not clients.admit("10.0.0.1")
    assert len(lines) == 1
    assert lines[0]["event"] == "http_connection_refused" and lines[0]["client"] == "10.0.0.1"
    assert lines[0]["limit"] == 1 and lines[0]["open"] == 1 and lines[0]["suppressed"] == 0
    clock.now = 10.0  # a new window: one more line, with the count held back
    assert not clients.admit("10.0.0.1")
    assert len(lines) == 2 and lines[1]["suppressed"] == 4
