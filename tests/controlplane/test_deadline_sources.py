"""A request's deadline in the control plane, without servers: its sources (the smallest
applies), the bounds of a client's `timeout`, the time left a data plane is sent, the error a
client gets (naming what set the deadline), and the HTTP API's 504 and stream end."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedserve.controlplane.deadlines import MAX_TIMEOUT_MS, MAX_TIMEOUT_S, request_deadline, timeout_ms
from pagedserve.controlplane.edge.http_server import create_app
from pagedserve.controlplane.errors import ServiceError, named_error
from pagedserve.controlplane.frontend import Frontend
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dataplane_client import RequestEvent
from pagedserve.controlplane.routing.dispatcher import (
    DEADLINE_GRACE_S,
    Admitted,
    GenerationEvent,
    _next_event,
)
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

NOW = 1000.0
DROPPED = "the request's deadline passed while it was running on the data plane, after 1 generated token(s)"


def test_the_soonest_source_applies() -> None:
    assert request_deadline(None, None, None, now=NOW) is None
    call = request_deadline(NOW + 1, 5.0, 30.0, now=NOW)
    assert call is not None and (call.at, call.source, call.param) == (
        NOW + 1,
        "the call's gRPC deadline",
        None,
    )
    body = request_deadline(NOW + 9, 2.0, 30.0, now=NOW)
    assert body is not None and (body.at, body.source, body.param) == (NOW + 2, "timeout of 2 s", "timeout")
    server = request_deadline(None, None, 30.0, now=NOW)
    assert server is not None and server.at == NOW + 30
    assert server.source == "the server's --request-timeout of 30 s" and server.param is None


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, MAX_TIMEOUT_S * 2, True, "2"])
def test_a_nonsense_timeout_is_invalid_argument_naming_the_field(value: Any) -> None:
    with pytest.raises(ServiceError) as err:
        request_deadline(None, value, None, now=NOW)
    assert err.value.code == "INVALID_ARGUMENT" and err.value.param == "timeout"
    assert err.value.message.startswith("timeout must be")


def test_the_time_left_sent_to_the_data_plane() -> None:
    assert timeout_ms(None, now=NOW) == 0  # no deadline
    assert timeout_ms(NOW + 2.0001, now=NOW) == 2001  # rounded up: never sooner than the client's
    assert timeout_ms(NOW - 5, now=NOW) == 1  # already past: dropped at once, not "no deadline"
    assert timeout_ms(NOW + 1e9, now=NOW) == MAX_TIMEOUT_MS


def gen(
    deadline: float | None, source: str = "timeout of 2 s", param: str | None = "timeout"
) -> GenerationRequest:
    frontend = Frontend(FakeDispatcher(), Digits(), "tiny", metrics=ControlPlaneMetrics())  # type: ignore[arg-type]
    g = frontend.validate([1, 2], {"max_tokens": 4})
    return GenerationRequest(
        g.request_id, g.prompt_token_ids, g.sampling_params, deadline=deadline, deadline_source=source,
        deadline_param=param,
    )  # fmt: skip


def test_a_deadline_error_names_what_set_the_deadline() -> None:
    past = time.monotonic() - 0.01
    named = named_error(gen(past), ServiceError("DEADLINE_EXCEEDED", DROPPED))
    assert named.message == f"timeout of 2 s: {DROPPED}" and named.param == "timeout"
    # Sooner than the request's deadline: the queue timeout's own message stands.
    queued = ServiceError("DEADLINE_EXCEEDED", "no data plane had KV blocks for this request within 60.0s")
    assert named_error(gen(time.monotonic() + 60), queued) is queued
    other = ServiceError("UNAVAILABLE", "gone")
    assert named_error(gen(past), other) is other
    assert named_error(gen(None), queued) is queued


def test_the_control_plane_ends_a_call_its_data_plane_never_ends() -> None:
    async def run() -> None:
        events: asyncio.Queue[RequestEvent] = asyncio.Queue()
        with pytest.raises(ServiceError) as err:
            await _next_event(events, time.monotonic() - DEADLINE_GRACE_S + 0.05)
        assert err.value.code == "DEADLINE_EXCEEDED"
        delta = dataplane_pb2.TokenDelta(request_id="r")
        events.put_nowait(delta)
        assert await _next_event(events, time.monotonic() - 100) is delta  # what came is still read
        events.put_nowait(delta)
        assert await _next_event(events, None) is delta

    asyncio.run(run())


# -- over HTTP ------------------------------------------------------------------------------------


class Digits:
    vocab_size = 16
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [int(c) for c in text if c.isdigit()] or [1]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(t % 10) for t in token_ids)


class FakeDispatcher:
    """One token, then the data plane's DEADLINE_EXCEEDED once the request's deadline passed."""

    def __init__(self) -> None:
        info = SimpleNamespace(max_model_len=64, vocab_size=16, num_blocks=64, block_size=4)
        self.connections = {"dp:1": SimpleNamespace(info=info)}
        self.requests: list[GenerationRequest] = []

    async def wait_for_startup(self, deadline: float | None = None) -> None:
        """A data plane has served (the start-up wait is tested in tests/e2e/scaling)."""

    async def generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncIterator[GenerationEvent]:
        self.requests.append(request)
        yield Admitted("dp:1", 0.0, 0)
        yield dataplane_pb2.TokenDelta(request_id=request.request_id, index=0, token_ids=[7])
        assert request.deadline is not None
        await asyncio.sleep(max(0.0, request.deadline - time.monotonic()))
        raise ServiceError("DEADLINE_EXCEEDED", DROPPED)


def client(request_timeout_s: float | None = None) -> tuple[TestClient, FakeDispatcher]:
    dispatcher = FakeDispatcher()
    frontend = Frontend(
        dispatcher,  # type: ignore[arg-type]
        Digits(),  # type: ignore[arg-type]
        "tiny",
        metrics=ControlPlaneMetrics(),
        request_timeout_s=request_timeout_s,
    )
    return TestClient(create_app(frontend)), dispatcher


BODY = {"prompt": "12", "max_tokens": 8}


def test_http_timeout_is_a_504_naming_it() -> None:
    http, dispatcher = client(request_timeout_s=30.0)
    started = time.monotonic()
    response = http.post("/v1/completions", json={**BODY, "timeout": 0.2})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout"
    assert error["param"] == "timeout" and error["message"] == f"timeout of 0.2 s: {DROPPED}"
    # The body's 0.2 s, not the server's 30 s, was the request's deadline.
    deadline = dispatcher.requests[0].deadline
    assert deadline is not None and started < deadline < started + 5


def test_http_stream_ends_with_the_tokens_then_the_error() -> None:
    http, _ = client(request_timeout_s=0.2)
    response = http.post("/v1/completions", json={**BODY, "stream": True})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert json.loads(events[0])["choices"][0]["text"] == "7"
    error = json.loads(events[1])["error"]
    assert error["code"] == "deadline_exceeded" and error["param"] is None
    assert error["message"] == f"the server's --request-timeout of 0.2 s: {DROPPED}"
    assert events[2:] == ["[DONE]"]


@pytest.mark.parametrize("value", [0, -2, 1e9, "soon"])
def test_http_refuses_a_nonsense_timeout(value: Any) -> None:
    http, dispatcher = client()
    response = http.post("/v1/completions", json={**BODY, "timeout": value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "timeout"
    assert dispatcher.requests == []
