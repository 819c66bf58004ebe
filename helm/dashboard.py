"""The chart's Grafana dashboard (`files/grafana-dashboard.json`), written by `python -m
helm.generate`: the panels and their PromQL, against the metric names the planes export.
Imports no torch."""

from __future__ import annotations

from typing import Any

GENERATOR = "python -m helm.generate"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
CP = 'namespace=~"$namespace", pod=~"$controlplane_pods"'
DP = 'namespace=~"$namespace", pod=~"$dataplane_pods"'
RATE = "[$__rate_interval]"


def _quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    group = f"{by}, le" if by else "le"
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}{RATE})))",
            f"p{round(q * 100)}" + (f" {{{{{by}}}}}" if by else ""),
        )
        for q in (0.5, 0.9, 0.99)
    ]


def dashboard() -> dict[str, Any]:
    """The serving signals vLLM's metrics watch, per data plane: KV usage (blocks, tokens), preemptions, prefix-cache
    hit rate, running/waiting, TTFT/TPOT/ITL percentiles. Pods are told apart by name (the
    chart names them `<release>-pagedserve-controlplane-*` and `...-dataplane-<n>`)."""
    panels: list[dict[str, Any]] = []
    y = 0

    def row(title: str) -> None:
        nonlocal y
        panels.append(
            {"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )
        y += 1

    def panel(title: str, unit: str, targets: list[tuple[str, str]], x: int, w: int = 12) -> None:
        nonlocal y
        panels.append(
            {
                "type": "timeseries",
                "title": title,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": w, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "datasource": DATASOURCE,
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        if x + w >= 24:
            y += 8

    row("KV cache (per data plane)")
    panel(
        "KV cache usage (blocks)", "percentunit", [(f"pagedserve_kv_cache_usage_perc{{{DP}}}", "{{pod}}")], 0
    )
    panel(
        "KV cache usage (token slots of used blocks)",
        "percentunit",
        [(f"pagedserve_kv_cache_token_usage_perc{{{DP}}}", "{{pod}}")],
        12,
    )
    panel(
        "Prefix-cache hit rate (tokens)",
        "percentunit",
        [
            (
                f"sum by (pod) (rate(pagedserve_prefix_cache_hits_total{{{DP}}}{RATE}))"
                f" / sum by (pod) (rate(pagedserve_prefix_cache_queries_total{{{DP}}}{RATE}))",
                "{{pod}}",
            )
        ],
        0,
    )
    panel(
        "Preemptions and deadline drops",
        "ops",
        [
            (f"sum by (pod) (rate(pagedserve_num_preemptions_total{{{DP}}}{RATE}))", "preempted {{pod}}"),
            # Of those, the ones evicted for a waiting request of a strictly better priority.
            (
                f"sum by (pod) (rate(pagedserve_num_priority_preemptions_total{{{DP}}}{RATE}))",
                "for priority {{pod}}",
            ),
            # ... and for a waiting request of a tenant holding less than its share of the batch.
            (
                f"sum by (pod) (rate(pagedserve_num_fair_share_preemptions_total{{{DP}}}{RATE}))",
                "for a tenant's share {{pod}}",
            ),
            # Requests the scheduler dropped at their deadline (work nobody would read).
            (
                f"sum by (pod) (rate(pagedserve_deadline_exceeded_requests_total{{{DP}}}{RATE}))",
                "past deadline {{pod}}",
            ),
        ],
        12,
    )
    row("Scheduling")
    panel(
        "Running and waiting requests (per data plane)",
        "short",
        [
            (f"pagedserve_num_requests_running{{{DP}}}", "running {{pod}}"),
            (f"pagedserve_num_requests_waiting{{{DP}}}", "waiting {{pod}}"),
        ],
        0,
    )
    panel(
        "Control planes: admission queue and connected data planes",
        "short",
        [
            (f"sum(pagedserve_num_requests_queued{{{CP}}})", "queued for KV budget"),
            (f"count(max by (dataplane) (pagedserve_dataplane_up{{{CP}}}) == 1)", "data planes up"),
        ],
        12,
    )
    row("Latency (as clients see it, from the control planes)")
    panel("Time to first token", "s", _quantiles("pagedserve_time_to_first_token_seconds", CP), 0, 8)
    panel("Time per output token", "s", _quantiles("pagedserve_time_per_output_token_seconds", CP), 8, 8)
    panel("Inter-token latency", "s", _quantiles("pagedserve_inter_token_latency_seconds", CP), 16, 8)
    panel("Time in the admission queue", "s", _quantiles("pagedserve_request_queue_time_seconds", CP), 0)
    panel(
        "Requests and tokens",
        "ops",
        [
            (
                f"sum by (finished_reason) (rate(pagedserve_request_success_total{{{CP}}}{RATE}))",
                "{{finished_reason}}",
            ),
            (f"sum by (code) (rate(pagedserve_request_failure_total{{{CP}}}{RATE}))", "failed {{code}}"),
            (f"sum(rate(pagedserve_generation_tokens_total{{{CP}}}{RATE}))", "generated tokens/s"),
            (
                f"sum(rate(pagedserve_http_connections_refused_total{{{CP}}}{RATE}))",
                "HTTP connections refused (per-client cap)",
            ),
        ],
        12,
    )
    row("Latency per data plane (from arrival at the data plane)")
    panel(
        "Time to first token p90",
        "s",
        _quantiles("pagedserve_time_to_first_token_seconds", DP, by="pod")[1:2],
        0,
        8,
    )
    panel(
        "Time per output token p90",
        "s",
        _quantiles("pagedserve_time_per_output_token_seconds", DP, by="pod")[1:2],
        8,
        8,
    )
    panel("Engine step p90", "s", _quantiles("pagedserve_engine_step_seconds", DP, by="pod")[1:2], 16, 8)
    row("Speculative decoding (per data plane; flat when --speculative-config is off)")
    panel(
        "Drafted tokens accepted",
        "percentunit",
        [
            (
                f"sum by (pod) (rate(pagedserve_spec_decode_num_accepted_tokens_total{{{DP}}}{RATE}))"
                f" / sum by (pod) (rate(pagedserve_spec_decode_num_draft_tokens_total{{{DP}}}{RATE}))",
                "{{pod}}",
            )
        ],
        0,
    )
    panel(
        "Tokens per drafted run (1 + mean accepted)",
        "short",
        [
            (
                f"1 + sum by (pod) (rate(pagedserve_spec_decode_num_accepted_tokens_total{{{DP}}}{RATE}))"
                f" / sum by (pod) (rate(pagedserve_spec_decode_num_drafts_total{{{DP}}}{RATE}))",
                "{{pod}}",
            )
        ],
        12,
    )

    for i, p in enumerate(panels, start=1):
        p["id"] = i
    namespace_query = "label_values(pagedserve_num_requests_running, namespace)"
    return {
        "title": "pagedserve",
        "uid": "pagedserve",
        "description": f"pagedserve control and data planes. Generated by `{GENERATOR}`.",
        "tags": ["pagedserve", "llm"],
        "editable": True,
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "definition": namespace_query,
                    "query": {"query": namespace_query, "refId": "namespace"},
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                },
                {
                    "name": "controlplane_pods",
                    "label": "Control-plane pods (regex)",
                    "type": "textbox",
                    "query": ".+-controlplane-.+",
                },
                {
                    "name": "dataplane_pods",
                    "label": "Data-plane pods (regex)",
                    "type": "textbox",
                    "query": ".+-dataplane-[0-9]+",
                },
            ]
        },
        "panels": panels,
    }
