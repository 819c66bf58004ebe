"""The control plane's Prometheus metrics, served on its HTTP port at /metrics.

Latencies are measured here, as clients see them (queue, time to first token, time per
output token, inter-token latency, end to end). The data planes' state (KV usage, running
and waiting requests, prefix-cache counters, preemptions by mode, swap traffic and the host
pool) is read at scrape time from what
each data plane last reported on its stream, labelled `dataplane="HOST:PORT"`, so one scrape
of a `pagedserve serve` shows the whole system. Names: see dataplane/src/pagedserve/dataplane/server/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pagedserve.common.metrics import LATENCY_BUCKETS, PREFIX, TOKEN_LATENCY_BUCKETS, RequestMetrics


class _DataPlaneCollector(Collector):
    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Any]:
        links = list(self.dispatcher.connections.values())

        def family(kind: Callable[..., Any], name: str, doc: str, value: Callable[[Any], float]) -> Any:
            metric = kind(PREFIX + name, doc, labels=["dataplane"])
            for link in links:
                if link.info is not None:
                    metric.add_metric([link.address], value(link))
            return metric

        total = lambda link: link.stats.total_blocks or link.info.num_blocks  # noqa: E731
        yield family(
            GaugeMetricFamily,
            "kv_cache_usage_perc",
            "Fraction of the data plane's KV blocks in use (1 = full).",
            lambda c: 1 - c.stats.free_blocks / total(c) if total(c) else 0.0,
        )
        yield family(
            GaugeMetricFamily,
            "kv_cache_free_blocks",
            "Free KV blocks the data plane reported.",
            lambda c: c.stats.free_blocks,
        )
        yield family(
            GaugeMetricFamily,
            "kv_cache_reserved_blocks",
            "KV blocks this replica reserved for admitted requests not yet reported.",
            lambda c: c.budget.reserved_blocks,
        )
        yield family(
            GaugeMetricFamily,
            "num_requests_running",
            "Requests in the data plane's running batch.",
            lambda c: c.stats.num_running,
        )
        yield family(
            GaugeMetricFamily,
            "num_requests_waiting",
            "Requests waiting inside the data plane.",
            lambda c: c.stats.num_waiting,
        )
        yield family(
            GaugeMetricFamily,
            "prefix_cache_hit_rate",
            "Prefix-cache hit rate (tokens) the data plane reported.",
            lambda c: (
                c.stats.prefix_cache_hits / c.stats.prefix_cache_queries
                if c.stats.prefix_cache_queries
                else 0.0
            ),
        )
        yield family(
            CounterMetricFamily,
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            lambda c: c.stats.prefix_cache_queries,
        )
        yield family(
            CounterMetricFamily,
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            lambda c: c.stats.prefix_cache_hits,
        )
        yield family(
            CounterMetricFamily,
            "num_preemptions",
            "Requests preempted on the data plane.",
            lambda c: c.stats.num_preemptions,
        )
        by_mode = CounterMetricFamily(
            PREFIX + "num_preemptions_by_mode",
            "Requests preempted on the data plane, by how: swap (blocks copied to the host pool) or recompute.",
            labels=["dataplane", "mode"],
        )
        for link in links:
            if link.info is not None:
                by_mode.add_metric([link.address, "swap"], link.stats.num_preemptions_swap)
                by_mode.add_metric([link.address, "recompute"], link.stats.num_preemptions_recompute)
        yield by_mode
        yield family(
            CounterMetricFamily,
            "kv_blocks_swapped_out",
            "KV blocks the data plane copied from its device pool to its host pool.",
            lambda c: c.stats.blocks_swapped_out,
        )
        yield family(
            CounterMetricFamily,
            "kv_blocks_swapped_in",
            "KV blocks the data plane copied from its host pool back to its device pool.",
            lambda c: c.stats.blocks_swapped_in,
        )
        yield family(
            CounterMetricFamily,
            "kv_swap_seconds",
            "Time the data plane spent copying swapped KV blocks.",
            lambda c: c.stats.swap_seconds,
        )
        yield family(
            GaugeMetricFamily,
            "num_requests_swapped",
            "Requests preempted by swap on the data plane, waiting to resume.",
            lambda c: c.stats.num_swapped,
        )
        yield family(
            GaugeMetricFamily,
            "cpu_kv_cache_usage_perc",
            "Fraction of the data plane's host (swap) pool holding swapped-out KV (1 = full; 0 without one).",
            lambda c: (
                1 - c.stats.host_free_blocks / c.stats.host_total_blocks if c.stats.host_total_blocks else 0.0
            ),
        )
        yield family(
            GaugeMetricFamily,
            "cpu_kv_cache_total_blocks",
            "Blocks of the data plane's host (swap) pool.",
            lambda c: c.stats.host_total_blocks,
        )
        yield family(
            GaugeMetricFamily,
            "cpu_kv_cache_free_blocks",
            "Free blocks of the data plane's host (swap) pool.",
            lambda c: c.stats.host_free_blocks,
        )
        yield family(
            GaugeMetricFamily,
            "dataplane_up",
            "1 while the data plane's stream is connected and it is not draining.",
            lambda c: float(c.healthy),
        )
        yield GaugeMetricFamily(
            PREFIX + "num_requests_queued",
            "Requests in this control plane's admission queue.",
            value=len(self.dispatcher.admission),
        )
        info = InfoMetricFamily(
            PREFIX + "cache_config", "KV cache configuration of each data plane.", labels=["dataplane"]
        )
        for link in links:
            if link.info is not None:
                info.add_metric(
                    [link.address],
                    {
                        "block_size": str(link.info.block_size),
                        "num_gpu_blocks": str(link.info.num_blocks),
                        "kv_cache_dtype": link.info.kv_cache_dtype,
                        "enable_prefix_caching": str(link.info.enable_prefix_caching).lower(),
                    },
                )
        yield info


class _TenantCollector(Collector):
    """Per tenant: the admission queue, requests in progress, tokens admitted, refusals. The
    `tenant` label takes only the keys file's tenants (or `default` without keys)."""

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Any]:
        limits, admission = self.dispatcher.tenants, self.dispatcher.admission
        tenants = sorted(limits.policies)
        waiting, running = admission.waiting(), limits.in_progress
        families = [
            (
                GaugeMetricFamily,
                "tenant_requests_queued",
                "Requests in the admission queue, by tenant.",
                waiting,
            ),
            (
                GaugeMetricFamily,
                "tenant_requests_in_progress",
                "Requests queued or generating, by tenant (what max_concurrency limits).",
                running,
            ),
            (
                CounterMetricFamily,
                "tenant_admitted_tokens",
                "Tokens admitted (prompt + max_tokens × n), by tenant: what its fair share is charged.",
                admission.admitted_tokens,
            ),
        ]
        for kind, name, doc, values in families:
            metric = kind(PREFIX + name, doc, labels=["tenant"])
            for tenant in tenants:
                metric.add_metric([tenant], values.get(tenant, 0))
            yield metric
        refused = CounterMetricFamily(
            PREFIX + "tenant_refusals",
            "Requests refused RESOURCE_EXHAUSTED, by tenant and limit "
            "(max_concurrency, tokens_per_minute, queue_full).",
            labels=["tenant", "limit"],
        )
        for tenant in tenants:
            for limit in ("max_concurrency", "tokens_per_minute"):
                refused.add_metric([tenant, limit], limits.refused.get((tenant, limit), 0))
            refused.add_metric([tenant, "queue_full"], admission.refused.get(tenant, 0))
        yield refused


class ControlPlaneMetrics:
    def __init__(self, dispatcher: Any | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        if dispatcher is not None:
            self.registry.register(_DataPlaneCollector(dispatcher))
            if hasattr(dispatcher, "tenants"):  # (tests' stand-ins may have no tenants)
                self.registry.register(_TenantCollector(dispatcher))
        r = self.registry
        self.requests = RequestMetrics(r, "Request received")
        self.generation_tokens = self.requests.generation_tokens
        self.request_failure = Counter(
            PREFIX + "request_failure",
            "Requests refused or failed, by gRPC status code.",
            ["code"],
            registry=r,
        )
        self.http_connections_refused = Counter(
            PREFIX + "http_connections_refused",
            "HTTP connections closed as soon as accepted: their client address already held "
            "--http-max-connections-per-client open connections.",
            registry=r,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time in the admission queue.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.tool_requests = Counter(
            PREFIX + "tool_requests",
            "Chat requests that declared tools, by tool_choice (none, auto, required, function).",
            ["tool_choice"],
            registry=r,
        )
        self.tool_calls = Counter(
            PREFIX + "tool_calls",
            "Tool calls parsed from completions (forced and auto).",
            registry=r,
        )
        self.embedding_requests = Counter(
            PREFIX + "embedding_requests",
            "Embedding calls run (gRPC Embed, HTTP /v1/embeddings), each of one or more inputs.",
            registry=r,
        )
        self.embedding_inputs = Counter(
            PREFIX + "embedding_inputs",
            "Inputs embedded (one pooling request each on a data plane).",
            registry=r,
        )
        self.embedding_prompt_tokens = Counter(
            PREFIX + "embedding_prompt_tokens",
            "Prompt tokens of the inputs embedded.",
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between consecutive token deltas.",
            registry=r,
            buckets=TOKEN_LATENCY_BUCKETS,
        )

    def completion(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float,
        e2e: float,
        first_of_request: bool,
    ) -> None:
        self.requests.finished(
            reason, prompt_tokens, completion_tokens, ttft, e2e, count_prompt=first_of_request
        )

    def failure(self, code: str) -> None:
        self.request_failure.labels(code=code).inc()
