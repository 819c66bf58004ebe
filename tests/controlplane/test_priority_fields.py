"""`priority` in the control plane, without servers: its check (INVALID_ARGUMENT / HTTP 400
naming it), its way into the data plane's SubmitCommand, the admission queue's order (lower
first, FIFO among equals) and placement onto a data plane running worse-priority work."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedserve.common.priority import MAX_PRIORITY, MIN_PRIORITY
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.controlplane.edge.http_server import create_app
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.admission import AdmissionQueue
from pagedserve.controlplane.routing.placement import WAIT, Placement
from tests.controlplane.test_admission import Pool, make_queue, until_waiting
from tests.controlplane.test_deadline_sources import Digits, FakeDispatcher
from tests.controlplane.test_placement import plan, snap


def frontend() -> tuple[Frontend, FakeDispatcher]:
    dispatcher = FakeDispatcher()
    fe = Frontend(dispatcher, Digits(), "tiny", metrics=ControlPlaneMetrics())  # type: ignore[arg-type]
    return fe, dispatcher


def test_priority_is_checked_and_travels_to_the_data_plane() -> None:
    fe, _ = frontend()
    assert fe.validate([1, 2], {"max_tokens": 4}).to_proto().priority == 0
    for value in (-5, MIN_PRIORITY, MAX_PRIORITY):
        gen = fe.validate([1, 2], {"max_tokens": 4}, priority=value)
        assert gen.priority == value and gen.to_proto().priority == value
    for bad in (MIN_PRIORITY - 1, MAX_PRIORITY + 1, 2**40, True, 1.5):
        with pytest.raises(ServiceError) as err:
            fe.validate([1, 2], {"max_tokens": 4}, priority=bad)  # type: ignore[arg-type]
        assert err.value.code == "INVALID_ARGUMENT" and err.value.param == "priority"
        assert err.value.message.startswith("priority must be")


@pytest.mark.parametrize("value", [1_000_001, -1_000_001, "high", 2.5])
def test_http_refuses_a_bad_priority_with_400_naming_it(value: Any) -> None:
    fe, dispatcher = frontend()
    http = TestClient(create_app(fe))
    response = http.post("/v1/completions", json={"prompt": "12", "max_tokens": 2, "priority": value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "priority"
    assert dispatcher.requests == []


def test_http_priority_reaches_the_request() -> None:
    fe, dispatcher = frontend()
    http = TestClient(create_app(fe))
    for body in ({"priority": -3}, {"priority": None}, {}):
        # (the fake dispatcher ends each call with DEADLINE_EXCEEDED: only the request matters)
        http.post("/v1/completions", json={"prompt": "12", "max_tokens": 2, "timeout": 0.01, **body})
    assert [r.priority for r in dispatcher.requests] == [-3, 0, 0]  # (chat: the same validate call)


def test_the_admission_queue_places_lower_priorities_first_and_equals_in_order() -> None:
    async def run() -> None:
        pool = Pool(4)
        q: AdmissionQueue[str] = make_queue(pool, max_len=8)
        await q.admit(pool.placer("running", 4))
        tasks = {
            rid: asyncio.create_task(q.admit(pool.placer(rid, 4), priority=p))
            for rid, p in (("low-a", 10), ("mid", 5), ("low-b", 10), ("high", 0), ("mid-b", 5))
        }
        await until_waiting(q, 5)
        order: list[str] = []
        for _ in range(5):
            pool.budget.release(order[-1] if order else "running")
            q.poke()
            done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
            placed = [rid for rid, t in tasks.items() if t in done]
            assert len(placed) == 1
            order += placed
            del tasks[placed[0]]
        assert order == ["high", "mid", "mid-b", "low-a", "low-b"]

    asyncio.run(run())


def test_a_better_priority_skips_the_wait_where_worse_work_runs() -> None:
    request = GenerationRequest("r", tuple(range(3, 43)), SamplingParams(max_tokens=16))
    full = snap("full", free_blocks=0, worst_priority=10, in_flight=3)
    assert plan(replace(request, priority=10), full) == WAIT  # equal: no
    assert plan(request, full) == Placement("full", 4, 0)  # the default 0 is better than 10
    assert plan(replace(request, priority=0), replace(full, worst_priority=0)) == WAIT
    assert plan(replace(request, priority=-1), replace(full, worst_priority=0)) == Placement("full", 4, 0)
    assert plan(replace(request, priority=9), full) == Placement("full", 4, 0)
    # A data plane with room still wins over one that would have to preempt.
    assert plan(replace(request, priority=9), full, snap("roomy")) == Placement("roomy", 4, 0)
