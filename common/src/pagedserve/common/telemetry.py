"""OpenTelemetry tracing for both planes, configured by the standard `OTEL_*` variables.

Off by default: unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`) or an
OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
the API's no-op tracer is used and spans cost nothing. `OTEL_SERVICE_NAME` overrides the
service name; the OTLP exporter reads its own variables (headers, timeouts, protocol).

Context crosses the planes in W3C `traceparent` form: from a client's gRPC metadata or HTTP
headers into the control plane, and inside each `SubmitCommand` to the data plane (the
internal stream multiplexes many requests, so per-request context cannot ride on the
stream's metadata). Imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_configured = False


def tracing_requested() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(
        exporter
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_tracing(default_service_name: str) -> bool:
    """Install a TracerProvider with the exporter the environment asks for; True if tracing is on."""
    global _configured
    if _configured or not tracing_requested():
        return _configured
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    exporter: SpanExporter
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The W3C trace context of `ctx` (default: the current one) as a string map."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> otel_context.Context:
    """A context whose parent is the span described by `traceparent` in `carrier` (if any)."""
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    normalized = {str(k).lower(): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in items}
    return _propagator.extract(normalized)


def span_ids(span: trace.Span) -> dict[str, Any]:
    """trace_id / span_id of `span`, for log lines (empty for a non-recording span)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def trace_ids() -> dict[str, Any]:
    """trace_id / span_id of the current span (empty when there is none)."""
    return span_ids(trace.get_current_span())
