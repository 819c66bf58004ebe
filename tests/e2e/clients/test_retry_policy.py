"""The Python client's retry policy (docs/api.md, "Retries") against a scripted fake server:
exact attempt counts for UNAVAILABLE before and after the first token, RESOURCE_EXHAUSTED with
and without `retry-after`, errors that are never retried, the deadline covering all attempts;
sync and asyncio alike. The Go and Java clients meet the same fake in test_go_java_clients.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import grpc
import pytest

from pagedserve.clients.python import AsyncGenerationClient, GenerationClient
from pagedserve.clients.python import client as client_module
from pagedserve.clients.python import retry as retry_module
from pagedserve.clients.python.client import Completion, StreamChunk
from pagedserve.clients.python.retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from tests.e2e.clients.fake_server import EXPECTED_ATTEMPTS, PARTIAL, TEXT, FakeServer

_ids = itertools.count()


def prompt(scenario: str) -> str:
    return f"{scenario}#py-{next(_ids)}"


class Clock:
    """The sync client's clock, with its waits recorded and skipped: a backoff moves this clock
    forward instead of sleeping, so the waits are read, not timed (a loaded machine cannot
    stretch them), while the calls themselves still take their real time."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self._skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self._skipped

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self._skipped += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake_clock = Clock()
    monkeypatch.setattr(client_module, "time", fake_clock)
    monkeypatch.setattr(retry_module, "time", fake_clock)  # (the deadline checks live there)
    return fake_clock


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.stop()


def test_backoff_schedule_and_retry_after_rules() -> None:
    policy = RetryPolicy(jitter=0.0)
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert [policy.delay(n, False, unavailable) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, None]
    long = RetryPolicy(max_attempts=10, jitter=0.0)
    assert [long.delay(n, False, unavailable) for n in (5, 6, 7)] == [1.6, 2.0, 2.0]  # capped
    for _ in range(200):  # jitter takes up to 20% off, never adds
        assert 0.08 <= DEFAULT_RETRY.delay(1, False, unavailable) <= 0.1  # type: ignore[operator]
    assert policy.delay(1, True, unavailable) is None  # after the first token: never
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert policy.delay(1, False, exhausted, [("retry-after", "1.5")]) == 1.5
    assert policy.delay(1, False, exhausted, [("retry-after", b"2")]) == 2.0
    assert policy.delay(1, False, exhausted, []) is None
    assert policy.delay(1, False, exhausted, [("retry-after", "soon")]) is None
    assert policy.delay(1, False, exhausted, [("retry-after", "31")]) is None  # over max_retry_after_s
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INTERNAL,
    ):
        assert policy.delay(1, False, code, [("retry-after", "1")]) is None
    assert NO_RETRY.delay(1, False, unavailable) is None


@pytest.mark.parametrize("scenario", sorted(EXPECTED_ATTEMPTS))
def test_sync_client_attempts(fake: FakeServer, clock: Clock, scenario: str) -> None:
    p = prompt(scenario)
    with GenerationClient(fake.address, timeout=20) as client:
        items: list[StreamChunk | Completion] = []
        try:
            for item in client.generate_stream(p):
                items.append(item)
            error = None
        except grpc.RpcError as exc:
            error = exc
    assert fake.attempts(p) == EXPECTED_ATTEMPTS[scenario]
    text = "".join(i.text for i in items if isinstance(i, StreamChunk))
    if scenario in ("unavailable-twice", "exhausted-retry-after", "ok"):
        assert error is None and text == TEXT
    else:
        assert error is not None
    if scenario == "unavailable-always":
        assert error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[union-attr]
        assert len(clock.slept) == 3 and 0.56 <= sum(clock.slept) <= 0.7  # 0.1 + 0.2 + 0.4 s, less <= 20%
    if scenario == "exhausted-retry-after":
        assert clock.slept == [0.3]  # the server's retry-after, exactly
    if scenario == "broken-midstream":
        assert text == PARTIAL and error.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[union-attr]
    if scenario.startswith("exhausted-") and error is not None:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_unary_calls_retry_too_and_no_retry_disables(fake: FakeServer) -> None:
    p = prompt("unavailable-twice")
    with GenerationClient(fake.address, timeout=20) as client:
        assert client.tokenize(p) == [1, 2, 3]
    assert fake.attempts(p) == 3
    p = prompt("unavailable-twice")
    with (
        GenerationClient(fake.address, timeout=20, retry=NO_RETRY) as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        client.generate(p)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert fake.attempts(p) == 1


def test_the_deadline_covers_every_attempt(fake: FakeServer, clock: Clock) -> None:
    # retry-after 0.3 s does not fit in a 0.2 s deadline: one attempt, the server's error, no wait.
    p = prompt("exhausted-retry-after")
    with GenerationClient(fake.address, timeout=0.2) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(p)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fake.attempts(p) == 1 and clock.slept == []
    # Backoffs of 10 + 20 s fit in a 45 s deadline, the third (40 s) does not: 3 attempts, 2 waits.
    # (Long waits on the skipped clock: the calls' own real time never decides the count.)
    p = prompt("unavailable-always")
    slow = RetryPolicy(initial_backoff_s=10.0, max_backoff_s=60.0, jitter=0.0)
    with GenerationClient(fake.address, timeout=45, retry=slow) as client, pytest.raises(grpc.RpcError):
        client.generate(p)
    assert fake.attempts(p) == 3 and clock.slept == [10.0, 20.0]


def test_async_client_attempts(fake: FakeServer) -> None:
    async def run() -> None:
        async with AsyncGenerationClient(fake.address, timeout=20) as client:
            for scenario, expected in EXPECTED_ATTEMPTS.items():
                p = prompt(scenario)
                try:
                    out = await client.generate(p)
                    assert out[0].text == TEXT, scenario
                except grpc.aio.AioRpcError as exc:
                    assert scenario not in ("unavailable-twice", "exhausted-retry-after", "ok"), exc
                assert fake.attempts(p) == expected, scenario
            p = prompt("unavailable-twice")
            assert await client.tokenize(p) == [1, 2, 3]
            assert fake.attempts(p) == 3

    asyncio.run(run())
