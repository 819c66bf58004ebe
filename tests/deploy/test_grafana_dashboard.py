"""The Grafana dashboard the chart ships: its queries name only metrics the planes really
export (read from the metric classes' registries), each on the plane whose pods it selects;
it shows the serving signals (KV usage, preemptions, prefix-cache hits, queue, latency); its PromQL parses (`promtool check rules`); the optional
ConfigMap carries it for the Grafana sidecar."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from helm.dashboard import dashboard
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.dataplane.kvcache import PrefixCacheStats
from pagedserve.dataplane.server.metrics import DataPlaneMetrics
from tests.deploy.chart import CHART, objects, of_kind, render

METRIC = re.compile(r"\bpagedserve_[a-z0-9_]+\b")


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The series names a scrape of `registry` can show, from its families' names and types
    (families without samples yet, like per-data-plane gauges before a data plane connects,
    count too)."""
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "info": ("_info",),
        "summary": ("_sum", "_count", ""),
    }
    return {family.name + s for family in registry.collect() for s in suffixes.get(family.type, ("",))}


@cache
def exported() -> dict[str, set[str]]:
    stats = EngineStats(
        total_blocks=16,
        free_blocks=8,
        cached_blocks=2,
        token_usage=0.5,
        num_running=1,
        num_waiting=0,
        num_preemptions=0,
        prefix_cache=PrefixCacheStats(),
    )
    dp = DataPlaneMetrics(lambda: stats, {"block_size": "16"}, lambda: 0)
    cp = ControlPlaneMetrics(SimpleNamespace(connections={}, admission=[]))
    return {"dataplane": sample_names(dp.registry), "controlplane": sample_names(cp.registry)}


def targets(board: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def test_every_query_names_metrics_the_selected_plane_exports() -> None:
    names = exported()
    assert "pagedserve_kv_cache_token_usage_perc" in names["dataplane"]  # the registries were read
    assert "pagedserve_inter_token_latency_seconds_bucket" in names["controlplane"]
    for title, expr in targets(dashboard()):
        planes = [p for p in ("controlplane", "dataplane") if f"${p}_pods" in expr]
        assert len(planes) == 1, f"{title}: select one plane's pods: {expr}"
        used = set(METRIC.findall(expr))
        assert used, expr
        missing = used - names[planes[0]]
        assert not missing, f"{title}: the {planes[0]} exports no {sorted(missing)}"


def test_dashboard_shows_the_seeds_signals() -> None:
    exprs = " ".join(expr for _, expr in targets(dashboard()))
    for metric in (
        "pagedserve_kv_cache_usage_perc",
        "pagedserve_kv_cache_token_usage_perc",
        "pagedserve_num_preemptions_total",
        "pagedserve_prefix_cache_hits_total",
        "pagedserve_prefix_cache_queries_total",
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_time_per_output_token_seconds_bucket",
        "pagedserve_inter_token_latency_seconds_bucket",
    ):
        assert metric in exprs, metric
    per_dataplane = [e for _, e in targets(dashboard()) if "$dataplane_pods" in e]
    assert all("pod" in e for e in per_dataplane), "data-plane panels split by pod"


def test_promql_parses(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("PAGEDSERVE_REQUIRE_PROMTOOL"):
            pytest.fail("promtool not found: apt-get install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    concrete = {
        "$__rate_interval": "1m",
        "$namespace": ".*",
        "$controlplane_pods": ".+-controlplane-.+",
        "$dataplane_pods": ".+-dataplane-[0-9]+",
    }
    rules = []
    for i, (_, expr) in enumerate(targets(dashboard())):
        for variable, value in concrete.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"pagedserve:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_pod_regexes_match_the_charts_pod_names() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    cp, dp = variables["controlplane_pods"]["query"], variables["dataplane_pods"]["query"]
    assert re.fullmatch(cp, "llm-pagedserve-controlplane-7d9f8c6b5-x2x4z")
    assert re.fullmatch(dp, "llm-pagedserve-dataplane-0") and re.fullmatch(dp, "llm-pagedserve-dataplane-12")
    assert not re.fullmatch(cp, "llm-pagedserve-dataplane-0")
    assert not re.fullmatch(dp, "llm-pagedserve-controlplane-7d9f8c6b5-x2x4z")


def test_configmap_carries_the_dashboard_for_the_sidecar() -> None:
    pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
    objs = objects(render({"grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}}}))
    (cm,) = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pagedserve.json"]) == dashboard()
    assert json.loads((CHART / "files" / "grafana-dashboard.json").read_text()) == dashboard()
    assert not [
        o for o in of_kind(objects(render({})), "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")
    ]
