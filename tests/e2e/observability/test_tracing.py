"""OpenTelemetry: one trace spans the client, the control plane and the data plane.

In process: an in-memory exporter sees the span tree and its parent links. Across
processes: `pagedserve dataplane` and `pagedserve controlplane`, configured only by the
standard OTEL_* variables, export to an OTLP receiver on an ephemeral port.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import openai
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedserve.clients.python import AsyncGenerationClient
from pagedserve.clients.python.client import build_request
from pagedserve.common.telemetry import inject
from tests.e2e.harness import Process, ServerThread, engine_config

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def provider() -> TracerProvider:
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # set by an earlier test module in this process
        current.add_span_processor(SimpleSpanProcessor(EXPORTER))
        return current
    created = TracerProvider()
    created.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(created)
    return created


@pytest.fixture(scope="module")
def server(tiny: Path, provider: TracerProvider) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny), tiny)
    yield srv
    srv.close()


def spans_of(trace_id: int) -> dict[str, object]:
    spans = [s for s in EXPORTER.get_finished_spans() if s.context.trace_id == trace_id]
    return {s.name: s for s in spans}


def wait_for_spans(trace_id: int, names: set[str]) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = spans_of(trace_id)
        if names <= set(found):
            return found
        time.sleep(0.05)
    raise AssertionError(f"missing spans {names - set(spans_of(trace_id))}")


EXPECTED = {
    "pagedserve.request",
    "pagedserve.admission",
    "pagedserve.dataplane.request",
    "pagedserve.prefill",
    "pagedserve.decode",
}


def test_grpc_request_is_one_trace_across_both_planes(
    server: ServerThread, provider: TracerProvider, capfd: pytest.CaptureFixture[str]
) -> None:
    client_tracer = provider.get_tracer("test-client")
    with client_tracer.start_as_current_span("client.call") as client_span:
        metadata = tuple(inject().items())
        trace_id = client_span.get_span_context().trace_id

        async def call() -> None:
            async with AsyncGenerationClient(server.grpc_address) as client:
                request = build_request([5, 6, 7, 8], max_tokens=5, temperature=0.0, request_id="traced-1")
                call = client._stub.Generate(request, metadata=metadata)  # the raw stub, to attach metadata
                async for _ in call:
                    pass

        server._run(call())
    spans = wait_for_spans(trace_id, EXPECTED)
    request, admission = spans["pagedserve.request"], spans["pagedserve.admission"]
    dp, prefill, decode = (
        spans["pagedserve.dataplane.request"],
        spans["pagedserve.prefill"],
        spans["pagedserve.decode"],
    )
    assert request.parent.span_id == client_span.get_span_context().span_id  # type: ignore[attr-defined]
    assert admission.parent.span_id == request.context.span_id  # type: ignore[attr-defined]
    assert dp.parent.span_id == request.context.span_id  # type: ignore[attr-defined]
    assert prefill.parent.span_id == dp.context.span_id  # type: ignore[attr-defined]
    assert decode.parent.span_id == dp.context.span_id  # type: ignore[attr-defined]
    assert request.attributes["pagedserve.request_id"] == "traced-1"  # type: ignore[attr-defined]
    assert request.attributes["pagedserve.prompt_tokens"] == 4  # type: ignore[attr-defined]
    assert request.attributes["pagedserve.completion.0.tokens"] == 5  # type: ignore[attr-defined]
    assert admission.attributes["pagedserve.dataplane"] == server.dataplane.address  # type: ignore[attr-defined]
    assert dp.attributes["pagedserve.completion_tokens"] == 5  # type: ignore[attr-defined]
    assert prefill.end_time <= decode.start_time  # type: ignore[attr-defined]

    # The JSON log line of the finished request carries its request id and trace id.
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    (finished,) = [
        line
        for line in lines
        if line.get("event") == "request_finished" and line.get("request_id") == "traced-1"
    ]
    assert finished["trace_id"] == f"{trace_id:032x}"
    assert finished["level"] == "info" and finished["completion_tokens"] == 5
    assert not any("prompt" in key and isinstance(value, str) for key, value in finished.items())


def test_http_request_joins_the_callers_trace(server: ServerThread, provider: TracerProvider) -> None:
    with provider.get_tracer("test-client").start_as_current_span("client.http") as client_span:
        headers = inject()
        trace_id = client_span.get_span_context().trace_id
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0)
    model = server.controlplane.dispatcher.config.model
    client.completions.create(
        model=model, prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_headers=headers
    )
    spans = wait_for_spans(trace_id, EXPECTED)
    assert spans["pagedserve.request"].parent.span_id == client_span.get_span_context().span_id  # type: ignore[attr-defined]


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_separate_processes_export_one_trace_over_otlp(tiny: Path) -> None:
    receiver = _Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dp = Process(
            ["dataplane", "--port", "0", "--model", str(tiny), "--num-gpu-blocks-override", "32"],
            "listening on ",
        )
        cp = Process(
            [
                "controlplane",
                "--model",
                str(tiny),
                "--dataplane",
                dp.address,
                "--grpc-port",
                "0",
                "--http-port",
                "0",
            ],
            "gRPC on ",
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:

        async def call() -> None:
            async with AsyncGenerationClient(cp.address) as client:
                for _ in range(50):  # the control plane connects to the data plane in the background
                    try:
                        await client.generate([5, 6, 7], max_tokens=4, temperature=0.0)
                        return
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        await asyncio.sleep(0.1)

        asyncio.run(call())
        deadline = time.monotonic() + 15
        by_service: dict[str, set[bytes]] = {}
        names: set[str] = set()
        while time.monotonic() < deadline:
            by_service.clear()
            names.clear()
            for req in list(receiver.requests):
                for rs in req.resource_spans:
                    service = next(
                        a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                    )
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            by_service.setdefault(service, set()).add(span.trace_id)
                            names.add(span.name)
            if {"pagedserve-controlplane", "pagedserve-dataplane"} <= set(by_service) and names >= EXPECTED:
                break
            time.sleep(0.1)
        assert names >= EXPECTED, names
        shared = by_service["pagedserve-controlplane"] & by_service["pagedserve-dataplane"]
        assert len(shared) == 1, by_service
    finally:
        cp.kill()
        dp.kill()
        otlp.stop(0)
