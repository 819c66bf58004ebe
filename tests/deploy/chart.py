"""Render the Helm chart offline (helm-python-sdk: the Helm Go SDK through ctypes) and pick the
rendered objects apart; shared by the tests in this folder. No helm binary, no cluster."""

from __future__ import annotations

import copy
import importlib.util
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "helm" / "pagedserve"
RELEASE = "llm"
NAMESPACE = "serving"
KUBE_VERSION = "1.37.0"
# Kinds whose schema is a CustomResourceDefinition (not in kubernetes-validate's set).
CRD_KINDS = {"ServiceMonitor"}

HELM_MISSING = "helm-python-sdk not installed (pip install helm-python-sdk==0.2.2, a dev dependency)"
VALIDATE_MISSING = (
    "kubernetes-validate not installed (pip install kubernetes-validate==1.37.0, a dev dependency)"
)


def helm() -> Any:
    return pytest.importorskip("helm_python", reason=HELM_MISSING)


# The value sets CI renders: the defaults, the four (CPU-only, two GPU data planes,
# TLS + API keys + HPA + ServiceMonitor, an existing PVC for models), a trusted network, and
# mutual TLS to data planes found by DNS (dialled by IP: checked against a server name).
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu-only": {
        "engine": {"numThreads": 4, "kvCacheMemory": "1GiB", "maxNumSeqs": 32},
        "dataplane": {
            "replicas": 3,
            "resources": {"requests": {"cpu": "4", "memory": "6Gi"}, "limits": {"memory": "8Gi"}},
        },
        "models": {"persistence": {"enabled": True, "size": "5Gi", "storageClassName": "standard"}},
        "grafana": {"dashboard": {"enabled": True}},
        "networkPolicy": {
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ]
        },
    },
    "two-gpus": {
        "engine": {
            "device": "cuda",
            "dtype": "bfloat16",
            "gpuMemoryUtilization": 0.85,
            "kvCacheDtype": "fp8_e4m3",
            "maxModelLen": 4096,
            "maxNumSeqs": 128,
            "blockSize": 32,
        },
        "dataplane": {
            "replicas": 2,
            "gpusPerPod": 1,
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
        },
    },
    "secure": {
        "apiKeys": {"keys": ["key-one", "key-two"]},
        "tls": {
            "public": {"enabled": True, "secretName": "pagedserve-public-tls"},
            "dataplane": {
                "enabled": True,
                "serverSecretName": "pagedserve-dataplane-tls",
                "clientSecretName": "pagedserve-controlplane-client-tls",
            },
        },
        "controlplane": {
            "discovery": "static",
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        },
        "dataplane": {"replicas": 2},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "otel": {
            "endpoint": "http://otel-collector.observability:4317",
            "headersSecret": {"name": "otel-auth", "key": "headers"},
            "resourceAttributes": "deployment.environment=prod",
        },
    },
    "tls-dns": {
        "tls": {
            "dataplane": {
                "enabled": True,
                "serverSecretName": "pagedserve-dataplane-tls",
                "clientSecretName": "pagedserve-controlplane-client-tls",
            },
        },
        "dataplane": {"replicas": 3},
    },
    "trusted-network": {
        "dataplaneAuth": {"token": {"enabled": False}, "allowInsecure": True},
        "networkPolicy": {"enabled": False},
        "controlplane": {"podDisruptionBudget": {"enabled": False}, "replicas": 1},
    },
    "existing-pvc": {
        "models": {"existingClaim": "llm-models", "pull": {"enabled": False}},
        "engine": {"model": "SmolLM2-135M-Instruct"},
        "controlplane": {"settings": {"servedModelNames": ["smol", "/models/llama-7b-hf"]}},
    },
}


def render(values: dict[str, Any] | None = None, name: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text."""
    with helm().Chart.load(str(CHART)) as chart:
        out: dict[str, str] = chart.render(values=values, name=name, namespace=NAMESPACE)
        return out


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object in the rendered templates (NOTES.txt left out)."""
    out = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append(doc)
    return out


def one(objs: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = list(of_kind(objs, kind, component))
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def of_kind(objs: list[dict[str, Any]], kind: str, component: str | None = None) -> Iterator[dict[str, Any]]:
    for obj in objs:
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] == kind and (
            component is None or labels.get("app.kubernetes.io/component") == component
        ):
            yield obj


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def port(c: dict[str, Any], name: str) -> int:
    (found,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(found)


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def command_line(c: dict[str, Any]) -> str:
    return shlex.join(c.get("args", []))


@cache
def load_drain_script() -> ModuleType:
    """The data planes' preStop hook (files/drain.py, shipped in a ConfigMap) as a module."""
    path = CHART / "files" / "drain.py"
    spec = importlib.util.spec_from_file_location("pagedserve_drain_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
