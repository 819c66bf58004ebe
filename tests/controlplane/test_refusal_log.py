"""The refusal log: one line per reason per interval, the count of those it stands for, the
tail of a burst written when its interval ends; figures do not split a reason."""

from __future__ import annotations

import pytest
import structlog

from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.refusals import PUBLIC_SERVER_OPTIONS, RefusalLog, refusal_reason
from tests.clock import FakeClock


def full(waiting: int) -> ServiceError:
    message = f"admission queue is full ({waiting} requests waiting for KV blocks); retry in 1.5 s"
    return ServiceError("RESOURCE_EXHAUSTED", message, retry_after_s=1.5)


def test_one_line_per_reason_per_interval_with_the_count() -> None:
    clock = FakeClock()
    refusals = RefusalLog(interval_s=10.0, clock=clock)
    with structlog.testing.capture_logs() as logs:
        for i in range(1_000):  # no running loop: the next refusal after the interval flushes
            refusals.note(full(i), request_id=f"r{i}")
            clock.now += 0.015  # 1,000 refusals over 15 s
        refusals.note(ServiceError("DEADLINE_EXCEEDED", "no data plane had KV blocks within 0.5s"))
    lines = [entry for entry in logs if entry["event"] == "requests_refused"]
    assert [(line["code"], line["count"]) for line in lines] == [
        ("RESOURCE_EXHAUSTED", 1),
        ("RESOURCE_EXHAUSTED", 667),  # the first 10 s after the first line, written by the next
        ("DEADLINE_EXCEEDED", 1),
    ]
    assert lines[1]["retry_after_s"] == 1.5 and lines[1]["request_id"] == "r667"


def test_the_tail_of_a_burst_is_written_when_its_interval_ends() -> None:
    clock = FakeClock()
    refusals = RefusalLog(interval_s=10.0, clock=clock)
    with structlog.testing.capture_logs() as logs:

        def counts() -> list[object]:
            return [line["count"] for line in logs if line["event"] == "requests_refused"]

        for i in range(100):
            refusals.note(full(i))
            clock.advance(0.0625)
        assert counts() == [1]
        clock.advance(10.0 - 100 * 0.0625 - 0.0625)
        assert counts() == [1]
        clock.advance(0.0625)  # the interval ends: its scheduled flush writes the tail
        assert counts() == [1, 99]


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (full(3), full(1024), True),
        (full(3), ServiceError("RESOURCE_EXHAUSTED", "something else"), False),
        (ServiceError("INTERNAL", "request id a1"), ServiceError("INTERNAL", "request id b2"), True),
    ],
)
def test_figures_do_not_split_a_reason(a: ServiceError, b: ServiceError, same: bool) -> None:
    assert (refusal_reason(a) == refusal_reason(b)) is same


def test_grpc_cores_drops_are_off() -> None:
    options = dict(PUBLIC_SERVER_OPTIONS)
    assert options["grpc.server.max_pending_requests"] >= 2**31 - 1
    assert options["grpc.server.max_pending_requests_hard_limit"] >= 2**31 - 1
    assert options["grpc.server_max_unrequested_time_in_server"] >= 2**31 - 1
