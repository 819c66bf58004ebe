"""`pagedserve doctor --url URL`: read a running server's metrics and apply tuning rules of thumb.

Rules (rules of thumb in the spirit of vLLM's "Optimization and Tuning" guide,
https://docs.vllm.ai/en/latest/configuration/optimization.html, with the thresholds as flags):
- KV cache usage above 90% in every sample of the window: the pool is the bottleneck; add
  data planes (or memory) or lower `--max-num-seqs`.
- Prefix-cache hit rate below 30% once enough prompt tokens were looked up: prefix caching
  costs hashing and keeps blocks cached for little reuse; consider `--no-enable-prefix-caching`.
- Preemptions above 5% of finished requests (over the window when it saw traffic, else since
  start): requests are swapped out or recomputed; give the KV cache more memory or lower
  `--max-num-seqs`.
- Recompute preemptions (same ratio and scope) making up most preemptions while the host
  (swap) pool stayed below 90% full in every sample: recompute re-does the victims' tokens
  where a swap would copy blocks; try `--preemption-mode swap` (or `auto`). With no host pool
  at all: give one with `--swap-space` and `--preemption-mode auto`.
- The host (swap) pool above 90% full in at least half the samples: swap-outs fall back to
  recompute; raise `--swap-space`.

It reads either a control plane's /metrics (one finding per data plane, labelled) or a data
plane's own. Finished requests are `pagedserve_request_success_total` (summed over its
reasons) on both: a data plane counts the completions it ran, a control plane those its
clients saw finish, on all its data planes together (it exports no per-data-plane count), so
there each data plane's preemptions are weighed against all of them. Exit status: 0 no
findings, 1 findings, 2 the server could not be read.
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
    # Preemption by swap and the host (swap) pool (0 on a server without them).
    preemptions_swap: float = 0.0
    preemptions_recompute: float = 0.0
    blocks_swapped_out: float = 0.0
    blocks_swapped_in: float = 0.0
    swap_seconds: float = 0.0
    swapped: float = 0.0  # requests swapped out now
    host_usage: float = 0.0
    host_total_blocks: float = 0.0
    host_free_blocks: float = 0.0
    # A CPU data plane's `pagedserve_cpu_kernels_info` labels: cpu_model, flags, isa,
    # native_isa, linear (each linear shape's kernel); empty where it exports none.
    kernels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    kv_usage: float = 0.90
    hit_rate: float = 0.30
    min_prefix_queries: float = 1000.0  # prompt tokens looked up before the hit rate means anything
    preemption_ratio: float = 0.05
    host_usage: float = 0.90  # the host (swap) pool counts as full above this


@dataclass
class Finding:
    dataplane: str
    rule: str
    message: str
    numbers: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> dict[str, Sample]:
    """Per data plane: label `dataplane` on a control plane's exposition, "" on a data plane's.

    `finished` is the exposition's finished completions (`request_success_total`, all
    reasons): on a control plane, those of all its data planes together, given to each."""
    out: dict[str, Sample] = defaultdict(Sample)
    successes = 0.0
    fields = {
        P + "kv_cache_usage_perc": "kv_usage",
        P + "prefix_cache_queries_total": "prefix_queries",
        P + "prefix_cache_hits_total": "prefix_hits",
        P + "num_preemptions_total": "preemptions",
        P + "num_requests_running": "running",
        P + "num_requests_waiting": "waiting",
        P + "kv_blocks_swapped_out_total": "blocks_swapped_out",
        P + "kv_blocks_swapped_in_total": "blocks_swapped_in",
        P + "kv_swap_seconds_total": "swap_seconds",
        P + "num_requests_swapped": "swapped",
        P + "cpu_kv_cache_usage_perc": "host_usage",
        P + "cpu_kv_cache_total_blocks": "host_total_blocks",
        P + "cpu_kv_cache_free_blocks": "host_free_blocks",
    }
    by_mode = {"swap": "preemptions_swap", "recompute": "preemptions_recompute"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in fields:
                setattr(out[s.labels.get("dataplane", "")], fields[s.name], s.value)
            elif s.name == P + "num_preemptions_by_mode_total" and s.labels.get("mode") in by_mode:
                setattr(out[s.labels.get("dataplane", "")], by_mode[s.labels["mode"]], s.value)
            elif s.name == P + "request_success_total":
                successes += s.value
            elif s.name == P + "cpu_kernels_info":
                labels = dict(s.labels)
                out[labels.pop("dataplane", "")].kernels = labels
    for sample in out.values():
        sample.finished = successes
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
        window = s.finished - f.finished > 0
        scope = "during the window" if window else "since start"

        def counted(name: str, s: Sample = s, f: Sample = f, window: bool = window) -> float:
            value: float = getattr(s, name)
            return value - float(getattr(f, name)) if window else value

        pre, fin = counted("preemptions"), counted("finished")
        swap, rec = counted("preemptions_swap"), counted("preemptions_recompute")
        if pre > 0 and pre > thresholds.preemption_ratio * max(fin, 1.0):
            findings.append(
                Finding(
                    label,
                    "preemptions",
                    f"{pre:.0f} preemptions for {fin:.0f} finished requests {scope} "
                    f"({pre / max(fin, 1.0):.1%} > {thresholds.preemption_ratio:.0%}; {swap:.0f} swap, "
                    f"{rec:.0f} recompute): requests are being swapped out or recomputed; give the KV cache more "
                    "memory (--kv-cache-memory / --gpu-memory-utilization) or lower --max-num-seqs",
                    {"preemptions": pre, "finished": fin, "swap": swap, "recompute": rec},
                )
            )
        host = [x[dp].host_usage for x in samples if dp in x]
        if rec > 0 and rec > thresholds.preemption_ratio * max(fin, 1.0) and rec > swap:
            if not s.host_total_blocks:
                findings.append(
                    Finding(
                        label,
                        "preemption_mode",
                        f"{rec:.0f} of {pre:.0f} preemptions {scope} recomputed their requests and there is no "
                        "host (swap) pool: recompute re-does every victim's tokens; give it one with --swap-space "
                        "(GiB) and --preemption-mode auto",
                        {"recompute": rec, "swap": swap, "host_total_blocks": 0.0},
                    )
                )
            elif max(host) < thresholds.host_usage:
                findings.append(
                    Finding(
                        label,
                        "preemption_mode",
                        f"{rec:.0f} of {pre:.0f} preemptions {scope} recomputed their requests while the host (swap) "
                        f"pool was at most {max(host):.0%} full ({s.host_total_blocks:.0f} blocks): recompute re-does "
                        "the victims' tokens where a swap would copy their blocks; try --preemption-mode swap",
                        {"recompute": rec, "swap": swap, "max_host_usage": max(host)},
                    )
                )
        full = sum(u > thresholds.host_usage for u in host)
        if s.host_total_blocks and full and 2 * full >= len(host):
            findings.append(
                Finding(
                    label,
                    "host_pool",
                    f"host (swap) pool above {thresholds.host_usage:.0%} full in {full} of {len(host)} samples "
                    f"(max {max(host):.1%} of {s.host_total_blocks:.0f} blocks): swap-outs that do not fit fall back "
                    "to recompute; raise --swap-space",
                    {"full_samples": float(full), "max_host_usage": max(host)},
                )
            )
    return findings


def swap_line(s: Sample) -> str:
    """Preemptions by mode, swap traffic and the host pool, in one line."""
    pool = (
        f"host pool {s.host_total_blocks - s.host_free_blocks:.0f} of {s.host_total_blocks:.0f} blocks in use "
        f"({s.host_usage:.1%})"
        if s.host_total_blocks
        else "no host pool"
    )
    return (
        f"preemptions by mode: swap {s.preemptions_swap:.0f}, recompute {s.preemptions_recompute:.0f}; "
        f"blocks swapped out {s.blocks_swapped_out:.0f}, in {s.blocks_swapped_in:.0f} "
        f"({s.swap_seconds:.3f} s copying); swapped now {s.swapped:.0f}; {pool}"
    )


def kernels_line(kernels: dict[str, str]) -> str:
    k = kernels
    line = f"cpu: {k.get('cpu_model', '?')}; flags {k.get('flags') or 'none of note'}; kernels {k.get('isa', '?')}"
    if k.get("native_isa") and k.get("native_isa") != k.get("isa"):
        line += f" (this CPU runs {k['native_isa']})"
    return line + (f"; linears {k['linear']}" if k.get("linear") else "")


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
    p.add_argument("--host-usage-threshold", type=float, default=Thresholds.host_usage)
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    url = metrics_url(args.url)
    thresholds = Thresholds(
        args.kv_usage_threshold,
        args.hit_rate_threshold,
        args.min_prefix_queries,
        args.preemption_ratio,
        args.host_usage_threshold,
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
            f"finished {s.finished:.0f}{' (all data planes, as the control plane counts them)' if dp else ''}"
        )
        print(f"  {swap_line(s)}")
        if s.kernels:
            print(f"  {kernels_line(s.kernels)}")
    if not findings:
        print("no findings: usage, prefix-cache hit rate, preemptions and the host pool are within the rules")
        return 0
    for f in findings:
        print(f"[{f.rule}] {f.dataplane}: {f.message}")
    return 1
