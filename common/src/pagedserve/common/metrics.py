"""Metric definitions both planes share: the name prefix, latency buckets and the per-request
counters and histograms. Imports no torch.

Names follow vLLM's metrics (https://docs.vllm.ai/en/latest/usage/metrics/) under our
prefix, with `_` instead of `:`:
`promtool check metrics` (and Prometheus' naming rules) reserve colons for recording rules,
so `vllm:kv_cache_usage_perc` becomes `pagedserve_kv_cache_usage_perc`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PREFIX = "pagedserve_"
# Seconds; covers sub-10 ms decode steps on a GPU up to minute-long CPU requests.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    2.5,
    5,
)


class RequestMetrics:
    """Counters and latency histograms of finished requests; both planes keep one, the data
    plane timing from a request's arrival there, the control plane from its client's call."""

    def __init__(self, registry: CollectorRegistry, clock: str) -> None:
        r = registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished completions by reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            f"{clock} to first token.",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            registry=r,
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", f"{clock} to finish.", registry=r, buckets=LATENCY_BUCKETS
        )

    def finished(
        self,
        reason: str,
        prompt_tokens: int,
        output_tokens: int,
        ttft: float,
        e2e: float,
        count_prompt: bool = True,
    ) -> None:
        """One finished completion; `count_prompt` False for the 2nd..nth sample of a request."""
        self.request_success.labels(finished_reason=reason).inc()
        if count_prompt:
            self.prompt_tokens.inc(prompt_tokens)
        if ttft > 0:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))
        self.e2e.observe(e2e)
