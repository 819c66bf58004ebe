"""`pagedserve doctor --url URL`: read a running server's metrics and apply the seed's tuning rules.

Rules (the seed document's, with the thresholds as flags):
- KV cache usage above 90% in every sample of the window: the pool is the bottleneck; add
  data planes (or memory) or lower `--max-num-seqs`.
- Prefix-cache hit rate below 30% once enough prompt tokens were looked up: prefix caching
  costs hashing and keeps blocks cached for little reuse; consider `--no-enable-prefix-caching`.
- Preemptions above 5% of finished requests (over the window when it saw traffic, else since
  start): requests are recomputed; give the KV cache more memory or lower `--max-num-seqs`.

It reads either a control plane's /metrics (one finding per data plane, labelled) or a data
plane's own. Exit status: 0 no findings, 1 findings, 2 the server could not be read. No torch.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

P = "pagedserve_"


@dataclass
class Sample:
    """One scrape of one data plane."""

    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    finished: float = 0.0
    running: float = 0.0
    waiting: float = 0.0


@dataclass(frozen=True)
class Thresholds:
    kv_usage: float = 0.90
    hit_rate: float = 0.30
    min_prefix_queries: float = 1000.0  # prompt tokens looked up before the hit rate means anything
    preemption_ratio: float = 0.05


@dataclass
class Finding:
    dataplane: str
    rule: str
    message: str
    numbers: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> dict[str, Sample]:
    """Per data plane: label `dataplane` on a control plane's exposition, "" on a data plane's."""
    out: dict[str, Sample] = defaultdict(Sample)
    successes = 0.0
    fields = {
        P + "kv_cache_usage_perc": "kv_usage",
        P + "prefix_cache_queries_total": "prefix_queries",
        P + "prefix_cache_hits_total": "prefix_hits",
        P + "num_preemptions_total": "preemptions",
        P + "num_requests_running": "running",
        P + "num_requests_waiting": "waiting",
        P + "dataplane_finished_requests_total": "finished",
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in fields:
                setattr(out[s.labels.get("dataplane", "")], fields[s.name], s.value)
            elif s.name == P + "request_success_total":
                successes += s.value
    if "" in out:  # a data plane's own exposition: its finished requests are its successes
        out[""].finished = successes
    return dict(out)


def diagnose(
    samples: list[dict[str, Sample]], thresholds: Thresholds = Thresholds(), window_s: float = 0.0
) -> list[Finding]:
    findings: list[Finding] = []
    if not samples:
        return findings
    last, first = samples[-1], samples[0]
    for dp in sorted(last):
        usages = [s[dp].kv_usage for s in samples if dp in s]
        label = dp or "this data plane"
        if usages and min(usages) > thresholds.kv_usage:
            sustained = (
                f"in all {len(usages)} samples over {window_s:.0f} s"
                if len(usages) > 1
                else "in the one sample taken (use --samples to check it is sustained)"
            )
            findings.append(
                Finding(
                    label,
                    "kv_usage",
                    f"KV cache usage above {thresholds.kv_usage:.0%} {sustained} (min {min(usages):.1%}, mean "
                    f"{sum(usages) / len(usages):.1%}): add data planes or KV memory, or lower --max-num-seqs",
                    {"min_usage": min(usages), "mean_usage": sum(usages) / len(usages)},
                )
            )
        s = last[dp]
        if s.prefix_queries >= thresholds.min_prefix_queries:
            rate = s.prefix_hits / s.prefix_queries
            if rate < thresholds.hit_rate:
                findings.append(
                    Finding(
                        label,
                        "prefix_hit_rate",
                        f"prefix-cache hit rate {rate:.1%} ({s.prefix_hits:.0f} of {s.prefix_queries:.0f} prompt tokens) "
                        f"is below {thresholds.hit_rate:.0%}: caching costs more than it saves here; consider "
                        "--no-enable-prefix-caching",
                        {"hit_rate": rate, "queries": s.prefix_queries, "hits": s.prefix_hits},
                    )
                )
        f = first.get(dp, s)
        d_pre, d_fin = s.preemptions - f.preemptions, s.finished - f.finished
        pre, fin, scope = (
            (d_pre, d_fin, "during the window") if d_fin > 0 else (s.preemptions, s.finished, "since start")
        )
        if pre > 0 and pre > thresholds.preemption_ratio * max(fin, 1.0):
            findings.append(
                Finding(
                    label,
                    "preemptions",
                    f"{pre:.0f} preemptions for {fin:.0f} finished requests {scope} "
                    f"({pre / max(fin, 1.0):.1%} > {thresholds.preemption_ratio:.0%}): requests are being recomputed; "
                    "give the KV cache more memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-num-seqs",
                    {"preemptions": pre, "finished": fin},
                )
            )
    return findings


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url if url.endswith("/metrics") else url + "/metrics"


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, Sample]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="read a running server's metrics and print tuning advice")
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the control plane's HTTP address (or any /metrics URL)",
    )
    p.add_argument(
        "--samples", type=int, default=3, help="scrapes to take (usage must stay high in all of them)"
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--kv-usage-threshold", type=float, default=Thresholds.kv_usage)
    p.add_argument("--hit-rate-threshold", type=float, default=Thresholds.hit_rate)
    p.add_argument("--min-prefix-queries", type=float, default=Thresholds.min_prefix_queries)
    p.add_argument("--preemption-ratio", type=float, default=Thresholds.preemption_ratio)
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    url = metrics_url(args.url)
    thresholds = Thresholds(
        args.kv_usage_threshold, args.hit_rate_threshold, args.min_prefix_queries, args.preemption_ratio
    )
    samples: list[dict[str, Sample]] = []
    start = time.monotonic()
    try:
        for i in range(max(1, args.samples)):
            if i:
                time.sleep(args.interval)
            samples.append(scrape(url))
    except OSError as exc:
        print(f"pagedserve doctor: cannot read {url}: {exc}", file=sys.stderr)
        return 2
    findings = diagnose(samples, thresholds, time.monotonic() - start)
    last = samples[-1]
    for dp, s in sorted(last.items()):
        rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        print(
            f"{dp or 'data plane'}: KV usage {s.kv_usage:.1%}, running {s.running:.0f}, waiting {s.waiting:.0f}, "
            f"prefix hit rate {rate:.1%} of {s.prefix_queries:.0f} tokens, preemptions {s.preemptions:.0f}, "
            f"finished {s.finished:.0f}"
        )
    if not findings:
        print("no findings: usage, prefix-cache hit rate and preemptions are within the rules")
        return 0
    for f in findings:
        print(f"[{f.rule}] {f.dataplane}: {f.message}")
    return 1
