"""The data plane's Prometheus metrics (one registry per process). Imports no torch.

Gauges and cumulative counters are read from the engine when Prometheus scrapes (a custom
collector: nothing to keep in sync); latency histograms are observed by the engine loop as
requests finish. Shared names and buckets: pagedserve/common/metrics.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pagedserve.common.metrics import PREFIX, TOKEN_LATENCY_BUCKETS, RequestMetrics


class _EngineCollector(Collector):
    """Scrape-time view of the pool, the scheduler and the prefix cache."""

    def __init__(self, engine: Any, info: dict[str, str], aborted: Any) -> None:
        self.engine = engine
        self.info = info
        self.aborted = aborted

    def collect(self) -> Iterator[Any]:
        pool, kv, sched = self.engine.pool, self.engine.kv_cache, self.engine.scheduler
        stats = kv.prefix_cache_stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", pool.usage)
        yield gauge(
            "kv_cache_token_usage_perc",
            "Fraction of the slots of used blocks that hold a token.",
            kv.token_usage,
        )
        yield gauge(
            "kv_cache_free_blocks",
            "KV blocks an allocation can take now (evictable cached included).",
            pool.num_free_blocks,
        )
        yield gauge(
            "kv_cache_cached_blocks", "KV blocks holding a prefix-cache hash.", pool.num_cached_blocks
        )
        yield gauge("num_requests_running", "Requests in the running batch.", sched.num_running)
        yield gauge(
            "num_requests_waiting", "Requests waiting for KV blocks or a batch slot.", sched.num_waiting
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hits / queries, in tokens, over first admissions.",
            stats.hit_rate,
        )
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.hits)
        yield counter(
            "num_preemptions", "Requests preempted (blocks freed, recomputed later).", sched.num_preemptions
        )
        yield counter("num_aborted_requests", "Requests aborted before they finished.", self.aborted())
        info = InfoMetricFamily(PREFIX + "cache_config", "KV cache configuration.")
        info.add_metric([], self.info)
        yield info


class DataPlaneMetrics:
    def __init__(self, engine: Any, cache_info: dict[str, str], aborted: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, cache_info, aborted))
        self.requests = RequestMetrics(self.registry, "Arrival at the data plane")
        self.step = Histogram(
            PREFIX + "engine_step_seconds",
            "Duration of one engine step.",
            registry=self.registry,
            buckets=TOKEN_LATENCY_BUCKETS,
        )

    def finished(self, reason: str, prompt_tokens: int, output_tokens: int, ttft: float, e2e: float) -> None:
        self.requests.finished(reason, prompt_tokens, output_tokens, ttft, e2e)

    def generated(self, num_tokens: int) -> None:
        self.requests.generation_tokens.inc(num_tokens)
