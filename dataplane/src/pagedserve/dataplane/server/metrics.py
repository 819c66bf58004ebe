"""The data plane's Prometheus metrics (one registry per process). Imports no torch.

Gauges and cumulative counters are read from the engine when Prometheus scrapes (a custom
collector: nothing to keep in sync); latency histograms are observed by the engine loop as
requests finish. Shared names and buckets: common/src/pagedserve/common/metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pagedserve.common.metrics import PREFIX, TOKEN_LATENCY_BUCKETS, RequestMetrics
from pagedserve.common.protocol import FINISH_REASON_NAMES
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.kernels.cpu_isa import cpu_report
from pagedserve.protos.pagedserve.v1 import dataplane_pb2


def kernel_info(engine: Any) -> dict[str, str] | None:
    """The `pagedserve_cpu_kernels_info` labels of a CPU engine: the CPU, its flags that
    matter, the kernel build and each linear shape's kernel; None off the CPU."""
    runner = getattr(engine, "runner", None)
    if runner is None or getattr(runner, "device", None) is None or runner.device.type != "cpu":
        return None
    cpu = cpu_report()
    choices = getattr(runner, "linear_choices", {}) or {}
    return {
        "cpu_model": str(cpu["model"]),
        "flags": " ".join(cpu["flags"]),
        "isa": str(cpu["kernel_isa"]),
        "native_isa": str(cpu["native_isa"]),
        "linear": " ".join(f"{c.in_features}x{c.out_features}={c.choice}" for c in choices.values()),
    }


def scheduler_counter(engine: Any, name: str) -> Callable[[], int]:
    """Reads a count the engine's scheduler keeps (0 for an engine without one, such as a
    test's fake): read from the scheduler, not EngineStats, which has no field for it."""

    def read() -> int:
        return int(getattr(getattr(engine, "scheduler", None), name, 0))

    return read


def priority_preemptions(engine: Any) -> Callable[[], int]:
    return scheduler_counter(engine, "num_priority_preemptions")


def fair_share_preemptions(engine: Any) -> Callable[[], int]:
    return scheduler_counter(engine, "num_fair_share_preemptions")


class _EngineCollector(Collector):
    """Scrape-time view of the pool, the scheduler and the prefix cache."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        info: dict[str, str],
        aborted: Callable[[], int],
        kernel_info: dict[str, str] | None = None,
        priority_preemptions: Callable[[], int] = lambda: 0,
        fair_share_preemptions: Callable[[], int] = lambda: 0,
    ) -> None:
        self.read_stats = stats
        self.info = info
        self.aborted = aborted
        self.kernel_info = kernel_info
        self.priority_preemptions = priority_preemptions
        self.fair_share_preemptions = fair_share_preemptions

    def collect(self) -> Iterator[Any]:
        stats = self.read_stats()
        prefix = stats.prefix_cache

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", stats.usage)
        yield gauge(
            "kv_cache_token_usage_perc",
            "Fraction of the slots of used blocks that hold a token.",
            stats.token_usage,
        )
        yield gauge(
            "kv_cache_free_blocks",
            "KV blocks an allocation can take now (evictable cached included).",
            stats.free_blocks,
        )
        yield gauge("kv_cache_cached_blocks", "KV blocks holding a prefix-cache hash.", stats.cached_blocks)
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge(
            "num_requests_waiting", "Requests waiting for KV blocks or a batch slot.", stats.num_waiting
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hits / queries, in tokens, over first admissions.",
            prefix.hit_rate,
        )
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", prefix.queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", prefix.hits)
        yield counter(
            "num_preemptions", "Requests preempted (swapped out or recomputed later).", stats.num_preemptions
        )
        by_mode = CounterMetricFamily(
            PREFIX + "num_preemptions_by_mode",
            "Requests preempted, by how: swap (blocks copied to the host pool) or recompute.",
            labels=["mode"],
        )
        by_mode.add_metric(["swap"], stats.num_preemptions_swap)
        by_mode.add_metric(["recompute"], stats.num_preemptions_recompute)
        yield by_mode
        yield counter(
            "num_priority_preemptions",
            "Requests preempted to make room for a waiting request of a strictly better priority "
            "(also counted in num_preemptions and by mode).",
            self.priority_preemptions(),
        )
        yield counter(
            "num_fair_share_preemptions",
            "Requests preempted to make room for a waiting request of a tenant holding fewer "
            "running requests per unit of weight (also counted in num_preemptions and by mode).",
            self.fair_share_preemptions(),
        )
        yield counter(
            "kv_blocks_swapped_out",
            "KV blocks copied from the device pool to the host pool.",
            stats.blocks_swapped_out,
        )
        yield counter(
            "kv_blocks_swapped_in",
            "KV blocks copied from the host pool back to the device pool.",
            stats.blocks_swapped_in,
        )
        yield counter("kv_swap_seconds", "Time spent copying swapped KV blocks.", stats.swap_seconds)
        yield gauge(
            "num_requests_swapped", "Requests preempted by swap, waiting to resume.", stats.num_swapped
        )
        yield gauge(
            "cpu_kv_cache_usage_perc",
            "Fraction of the host (swap) pool's blocks holding swapped-out KV (1 = full).",
            stats.host_usage,
        )
        yield gauge("cpu_kv_cache_total_blocks", "Blocks of the host (swap) pool.", stats.host_total_blocks)
        yield gauge(
            "cpu_kv_cache_free_blocks", "Free blocks of the host (swap) pool.", stats.host_free_blocks
        )
        yield counter("num_aborted_requests", "Requests aborted before they finished.", self.aborted())
        yield counter(
            "spec_decode_num_drafts",
            "Speculative decoding: drafted runs verified (one per sequence and step that drafted).",
            stats.spec_drafts,
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: drafted tokens verified.",
            stats.spec_draft_tokens,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: drafted tokens accepted (mean acceptance length = this / num_drafts).",
            stats.spec_accepted_tokens,
        )
        info = InfoMetricFamily(PREFIX + "cache_config", "KV cache configuration.")
        info.add_metric([], self.info)
        yield info
        if self.kernel_info:
            kernels = InfoMetricFamily(
                PREFIX + "cpu_kernels",
                "The CPU the data plane runs on and the kernels it chose at load (cpu_kernels_selected).",
            )
            kernels.add_metric([], self.kernel_info)
            yield kernels


class DataPlaneMetrics:
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        cache_info: dict[str, str],
        aborted: Callable[[], int],
        kernel_info: dict[str, str] | None = None,
        priority_preemptions: Callable[[], int] = lambda: 0,
        fair_share_preemptions: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(
            _EngineCollector(
                stats, cache_info, aborted, kernel_info, priority_preemptions, fair_share_preemptions
            )
        )
        self.requests = RequestMetrics(self.registry, "Arrival at the data plane")
        self.step = Histogram(
            PREFIX + "engine_step_seconds",
            "Duration of one engine step.",
            registry=self.registry,
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.constrained = Counter(
            PREFIX + "structured_output_requests",
            "Requests with a structured-output constraint, by kind (json_schema, json_object, regex, choice, grammar).",
            ["kind"],
            registry=self.registry,
        )
        self.constraint_refusals = Counter(
            PREFIX + "structured_output_refusals",
            "Constrained requests refused because their grammar did not compile (or not in time).",
            registry=self.registry,
        )
        self.request_faults = Counter(
            PREFIX + "request_faults",
            "Requests failed with INTERNAL because their own work in a step raised (the rest of "
            "the batch went on).",
            registry=self.registry,
        )
        self.deadline_drops = Counter(
            PREFIX + "deadline_exceeded_requests",
            "Requests dropped because their deadline (the client's time left) passed, by where "
            "they were: compiling (their grammar), waiting, running or swapped (also counted in "
            "num_aborted_requests).",
            ["state"],
            registry=self.registry,
        )
        self.grammar_wait = Histogram(
            PREFIX + "structured_output_compile_seconds",
            "Time from a constrained request's arrival until its grammar was ready (compiled, or "
            "from the cache) or refused.",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )

    def faulted(self) -> None:
        self.request_faults.inc()

    def deadline_exceeded(self, state: str) -> None:
        self.deadline_drops.labels(state=state).inc()

    def constrained_request(self, kind: str) -> None:
        self.constrained.labels(kind=kind).inc()

    def grammar_ready(self, seconds: float, refused: bool) -> None:
        self.grammar_wait.observe(seconds)
        if refused:
            self.constraint_refusals.inc()

    def finished(self, msg: dataplane_pb2.RequestFinished) -> None:
        """Observe a sample's end from its wire message: the numbers the control plane gets."""
        self.requests.finished(
            FINISH_REASON_NAMES[msg.finish_reason],
            msg.usage.prompt_tokens,
            msg.usage.completion_tokens,
            msg.time_to_first_token_seconds,
            msg.e2e_seconds,
        )

    def generated(self, num_tokens: int) -> None:
        self.requests.generation_tokens.inc(num_tokens)
