"""The Helm chart, rendered offline for the default values and the value sets CI checks: it
lints, every manifest passes Kubernetes' schemas in strict mode, and the rendered objects
agree with the servers (every container command line is accepted by the real `pagedserve`
parser; ports, probes, selectors, the NetworkPolicy peer, the discovery name, the Secrets'
files and every engine value on the data plane's command line)."""

from __future__ import annotations

import argparse
import base64
import dataclasses
from functools import cache
from typing import Any

import pytest

from helm.generate import CHART_MANAGED, Knob, blocks
from pagedserve.cli import build_parser
from pagedserve.common import settings
from pagedserve.controlplane.cli import build_parser as controlplane_parser
from pagedserve.dataplane.cli import dataplane_config_from_args
from pagedserve.dataplane.config import DataPlaneConfig
from pagedserve.dataplane.server.metrics_http import HEALTH_PATH
from tests.deploy.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    VALIDATE_MISSING,
    VALUE_SETS,
    container,
    helm,
    load_drain_script,
    matches,
    merged,
    objects,
    of_kind,
    one,
    pod_spec,
    port,
    render,
)

FULLNAME = f"{RELEASE}-pagedserve"
CP_NAME = f"{FULLNAME}-controlplane"
DP_NAME = f"{FULLNAME}-dataplane"


@cache
def rendered(name: str) -> list[dict[str, Any]]:
    return objects(render(VALUE_SETS[name]))


@cache
def chart_defaults() -> dict[str, Any]:
    with helm().Chart.load(str(CHART)) as chart:
        values: dict[str, Any] = chart.values
        return values


def parse(args: list[str]) -> argparse.Namespace:
    """The container's command line as its image's entrypoint parses it: `pagedserve` (the CPU
    and CUDA images), or `pagedserve-controlplane` (the control-plane image; its flags are
    `pagedserve controlplane`'s, and `command` is set to say so)."""
    try:
        if args and args[0].startswith("-"):
            return controlplane_parser().parse_args(args, argparse.Namespace(command="controlplane"))
        return build_parser().parse_args(args)
    except SystemExit as exc:  # argparse exits on an unknown flag or a bad value
        raise AssertionError(f"the image's entrypoint rejects: {args}") from exc


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def mounted_file(workload: dict[str, Any], container_name: str, path: str) -> tuple[str, str]:
    """(Secret or ConfigMap name, key) that provides `path` in the container."""
    c = container(workload, container_name)
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in c["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = volumes[mount["name"]]
            source = volume.get("secret", {}).get("secretName") or volume["configMap"]["name"]
            return source, path.removeprefix(prefix)
    raise AssertionError(f"{path} is not mounted in {container_name}")


# -- lint, schema, Kubernetes schemas ------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_lints_clean_in_strict_mode(name: str) -> None:
    report = helm().lint(str(CHART), VALUE_SETS[name] or None, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_manifest_passes_the_kubernetes_schemas_strictly(name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=VALIDATE_MISSING)
    objs = rendered(name)
    assert objs
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue  # a CRD's schema is not in the Kubernetes set: checked field by field below
        kv.validate(obj, KUBE_VERSION, strict=True)


def test_strict_validation_catches_an_unknown_field() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason=VALIDATE_MISSING)
    service = one(rendered("default"), "Service", "controlplane")
    broken = merged(service, {"spec": {"portz": []}})
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_schema_accepts_every_value_set(name: str) -> None:
    with helm().Chart.load(str(CHART)) as chart:
        chart.validate_schema(VALUE_SETS[name])


@pytest.mark.parametrize(
    "values",
    [
        {"engine": {"blockSize": 0}},
        {"engine": {"kvCacheDtype": "fp16"}},
        {"engine": {"gpuMemoryUtilization": 1.5}},
        {"engine": {"kvCacheMemory": "2 gigs"}},
        {"engine": {"noSuchKnob": 1}},
        {"engine": {"enablePrefixCaching": "yes"}},
        {"controlplane": {"discovery": "consul"}},
        {"controlplane": {"settings": {"queueTimeoutS": 0}}},
        {"dataplane": {"gpusPerPod": -1}},
        {"dataplane": {"port": 70000}},
        {"apiKeys": {"keys": ["# a comment"]}},
        {"apiKeys": {"keys": ["two\nlines"]}},
        {"unknownTopLevel": True},
    ],
)
def test_schema_refuses_bad_values(values: dict[str, Any]) -> None:
    with helm().Chart.load(str(CHART)) as chart, pytest.raises(helm().HelmValuesError):
        chart.validate_schema(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dataplane": {"gpusPerPod": 1}}, "engine.device=cuda"),
        ({"engine": {"device": "cuda"}}, "gpusPerPod >= 1"),
        ({"tls": {"public": {"enabled": True}}}, "tls.public.secretName"),
        ({"tls": {"dataplane": {"enabled": True, "serverSecretName": "s"}}}, "clientSecretName"),
        ({"apiKeys": {"existingSecret": "a", "keys": ["b"]}}, "not both"),
        ({"controlplane": {"discovery": "static"}, "dataplane": {"replicas": 0}}, "replicas >= 1"),
        ({"dataplaneAuth": {"token": {"enabled": False}}}, "need their callers to authenticate"),
    ],
)
def test_inconsistent_values_fail_the_render_with_a_reason(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm().HelmError, match=message):
        render(values)


# -- command lines -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_container_command_line_parses_with_the_real_cli(name: str) -> None:
    for workload in workloads(rendered(name)):
        spec = pod_spec(workload)
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert "command" not in c, "the image's entrypoint runs every container"
            args = parse(c["args"])
            assert args.command == {"controlplane": "controlplane", "dataplane": "dataplane"}.get(
                c["name"], "models"
            )
            # The control plane runs in its own image, without torch.
            assert c["image"].endswith("-controlplane") == (c["name"] == "controlplane"), c["image"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_data_plane_config_is_one_the_data_plane_accepts(name: str) -> None:
    """`pagedserve dataplane` builds its DataPlaneConfig from these flags: its checks (e.g. that
    control planes must authenticate off loopback) pass."""
    args = parse(container(one(rendered(name), "StatefulSet", "dataplane"), "dataplane")["args"])
    config = dataplane_config_from_args(args)
    assert config.host == "0.0.0.0"


def test_every_flag_of_both_planes_is_a_value_or_set_by_the_chart() -> None:
    """A flag added to a plane fails here until the chart sets it (or generates it)."""
    given: dict[str, set[str]] = {"dataplane": set(), "controlplane": set()}
    for name in VALUE_SETS:
        for workload in workloads(rendered(name)):
            for c in pod_spec(workload)["containers"]:
                given[c["name"]] |= {a.split("=")[0] for a in c["args"] if a.startswith("--")}
    for command, flags in given.items():
        sub = next(a for a in build_parser()._actions if a.dest == "command")
        parser = sub.choices[command]  # type: ignore[index]
        every = {
            a.option_strings[0]
            for a in parser._actions
            # Hidden flags are internal (`serve` and its child), --config-json replaces the others.
            if a.option_strings and a.help != argparse.SUPPRESS and a.dest not in ("help", "config_json")
        }
        generated = {k.flag for block in blocks() for k in block.knobs}  # each checked above
        # Never rendered: --api-key (keys come from a Secret's file, never the command line).
        missing = every - flags - generated
        assert missing <= {"--api-key"}, (command, sorted(missing))


def test_both_planes_share_the_dataplane_token() -> None:
    objs = rendered("default")
    deployment, sts = one(objs, "Deployment", "controlplane"), one(objs, "StatefulSet", "dataplane")
    cp_file = parse(container(deployment, "controlplane")["args"]).dataplane_token_file
    dp_file = parse(container(sts, "dataplane")["args"]).dataplane_token_file
    source = mounted_file(deployment, "controlplane", cp_file)
    assert source == mounted_file(sts, "dataplane", dp_file) == (f"{FULLNAME}-dataplane-token", "token")
    secret = next(o for o in of_kind(objs, "Secret") if o["metadata"]["name"] == source[0])
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 16 and token.isalnum()
    # A token the operator manages: the chart creates none and mounts theirs.
    own = objects(render({"dataplaneAuth": {"token": {"existingSecret": "my-token", "secretKey": "t"}}}))
    assert not list(of_kind(own, "Secret"))
    cp_args = parse(container(one(own, "Deployment", "controlplane"), "controlplane")["args"])
    assert mounted_file(
        one(own, "Deployment", "controlplane"), "controlplane", cp_args.dataplane_token_file
    ) == (
        "my-token",
        "t",
    )
    trusted = parse(
        container(one(rendered("trusted-network"), "StatefulSet", "dataplane"), "dataplane")["args"]
    )
    assert trusted.allow_insecure_dataplane and trusted.dataplane_token_file is None
    assert not list(of_kind(rendered("trusted-network"), "NetworkPolicy"))


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_ports_and_probes_agree_with_the_servers_flags(name: str) -> None:
    objs = rendered(name)
    values = merged(chart_defaults(), VALUE_SETS[name])
    public_tls, link_tls = values["tls"]["public"]["enabled"], values["tls"]["dataplane"]["enabled"]

    cp = container(one(objs, "Deployment", "controlplane"), "controlplane")
    cp_args = parse(cp["args"])
    assert cp_args.host == "0.0.0.0"
    assert port(cp, "grpc") == cp_args.grpc_port and port(cp, "http") == cp_args.http_port
    if public_tls:  # the native gRPC probe has no TLS: readiness reads the same signal over HTTPS
        assert cp["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    else:
        assert cp["readinessProbe"]["grpc"] == {"port": cp_args.grpc_port}
    assert cp["livenessProbe"]["httpGet"] == {
        "path": "/live",
        "port": "http",
        "scheme": "HTTPS" if public_tls else "HTTP",
    }
    service = one(objs, "Service", "controlplane")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"grpc": "grpc", "http": "http"}

    sts = one(objs, "StatefulSet", "dataplane")
    dp = container(sts, "dataplane")
    dp_args = parse(dp["args"])
    assert dp_args.host == "0.0.0.0" and dp_args.dataplane_id == "$(POD_NAME)"
    assert port(dp, "grpc") == dp_args.port and port(dp, "metrics") == dp_args.metrics_port
    # Every probe reads the engine loop's health, so a data plane whose loop has died is taken
    # out and restarted: gRPC health on its port, or (the native gRPC probe has no TLS) the
    # metrics port's /healthz, 503 once the loop has ended (tests/dataplane/server/test_metrics_http.py).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if link_tls:
            assert dp[probe]["httpGet"] == {"port": "metrics", "path": HEALTH_PATH}
            assert "grpc" not in dp[probe] and "tcpSocket" not in dp[probe]
        else:
            assert dp[probe]["grpc"] == {"port": dp_args.port}
            assert "httpGet" not in dp[probe] and "tcpSocket" not in dp[probe]
        assert {k: v for k, v in dp[probe].items() if k not in ("grpc", "httpGet")} == (
            values["dataplane"][probe]
        )
    annotations = pod_spec_annotations(sts)
    assert annotations["prometheus.io/port"] == str(dp_args.metrics_port)
    headless = one(objs, "Service", "dataplane")
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {
        "grpc": dp_args.port,
        "metrics": dp_args.metrics_port,
    }
    # Both planes find the model store where it is mounted.
    for c, args in ((cp, cp_args), (dp, dp_args)):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert args.model_home == mounts["models"] == values["models"]["mountPath"]


def pod_spec_annotations(workload: dict[str, Any]) -> dict[str, str]:
    annotations: dict[str, str] = workload["spec"]["template"]["metadata"].get("annotations", {})
    return annotations


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_selectors_match_their_pods_only(name: str) -> None:
    objs = rendered(name)
    pods = {w["metadata"]["labels"]["app.kubernetes.io/component"]: w for w in workloads(objs)}
    labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in pods.items()}
    for component, workload in pods.items():
        other = "dataplane" if component == "controlplane" else "controlplane"
        selector = workload["spec"]["selector"]["matchLabels"]
        assert matches(selector, labels[component]) and not matches(selector, labels[other])
        for kind in ("Service", "PodDisruptionBudget"):
            for obj in of_kind(objs, kind, component):
                spec_selector = obj["spec"]["selector"]
                spec_selector = spec_selector.get("matchLabels", spec_selector)
                assert matches(spec_selector, labels[component]), (kind, component)
                assert not matches(spec_selector, labels[other]), (kind, component)
        for monitor in of_kind(objs, "ServiceMonitor", component):
            service = one(objs, "Service", component)
            assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
            port_names = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    sts = one(objs, "StatefulSet", "dataplane")
    headless = one(objs, "Service", "dataplane")
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"] == DP_NAME
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": CP_NAME,
        }
        assert "replicas" not in one(objs, "Deployment", "controlplane")["spec"]


WITH_NETWORK_POLICY = sorted(
    n for n, v in VALUE_SETS.items() if v.get("networkPolicy", {}).get("enabled", True)
)


@pytest.mark.parametrize("name", WITH_NETWORK_POLICY)
def test_network_policy_lets_only_control_planes_reach_data_planes(name: str) -> None:
    objs = rendered(name)
    policy = one(objs, "NetworkPolicy")
    labels = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]["metadata"]["labels"]
        for w in workloads(objs)
    }
    assert matches(policy["spec"]["podSelector"]["matchLabels"], labels["dataplane"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rules = [r for r in policy["spec"]["ingress"] if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
    (rule,) = grpc_rules
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "no namespace-wide or IP peers on the gRPC port"
    assert matches(peer["podSelector"]["matchLabels"], labels["controlplane"])
    assert not matches(peer["podSelector"]["matchLabels"], labels["dataplane"])
    # Every other rule opens the metrics port only.
    for other in policy["spec"]["ingress"]:
        if other is not rule:
            assert other["ports"] == [{"port": "metrics", "protocol": "TCP"}]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_discovery_name_resolves_to_the_headless_service(name: str) -> None:
    objs = rendered(name)
    headless = one(objs, "Service", "dataplane")
    svc = headless["metadata"]["name"]
    grpc_port = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["grpc"]
    fqdn = f"{svc}.{NAMESPACE}.svc.cluster.local"
    args = parse(container(one(objs, "Deployment", "controlplane"), "controlplane")["args"])
    if args.dataplane_dns is not None:
        assert args.dataplanes is None
        assert args.dataplane_dns in (f"{fqdn}:{grpc_port}", f"{svc}:{grpc_port}")
    else:  # static: each StatefulSet pod by its stable name under the headless Service
        replicas = one(objs, "StatefulSet", "dataplane")["spec"]["replicas"]
        assert args.dataplanes == [f"{DP_NAME}-{i}.{fqdn}:{grpc_port}" for i in range(replicas)]


# -- engine and control-plane values -------------------------------------------------------------
def other_value(knob: Knob) -> Any:
    """A valid value unlike the default, for each kind of knob."""
    special: dict[str, Any] = {
        "kv_cache_memory": "512MiB",
        "gpu_memory_utilization": 0.75,
        "device": "cuda",
        "kv_cache_dtype": "fp8_e5m2",  # kv_scales_path needs an FP8 cache
        "model": "/models/custom-llama",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
    }
    if knob.name in special:
        return special[knob.name]
    if knob.choices:
        return next(c for c in knob.choices if c != knob.default)
    if knob.kind == "bool":
        return not knob.default
    if knob.kind == "int":
        return 7 if knob.default is None else knob.default + 3
    if knob.kind == "float":
        return 0.25 if knob.default is None else knob.default * 2 + 0.5
    if knob.kind == "list":
        return ["alpha", "beta"]
    return f"/etc/pagedserve/{knob.name}.json" if knob.name.endswith("path") else f"{knob.name}-x"


def test_every_engine_and_control_plane_value_reaches_its_flag() -> None:
    engine, cp_settings = blocks()
    values = {
        "engine": {k.key: other_value(k) for k in engine.knobs},
        "controlplane": {"settings": {k.key: other_value(k) for k in cp_settings.knobs}},
        "dataplane": {"gpusPerPod": 1},
        "models": {"pull": {"enabled": False}},
    }
    objs = objects(render(values))
    dp_args = parse(container(one(objs, "StatefulSet", "dataplane"), "dataplane")["args"])
    cp_args = parse(container(one(objs, "Deployment", "controlplane"), "controlplane")["args"])
    for block, args in ((engine, dp_args), (cp_settings, cp_args)):
        for knob in block.knobs:
            expected = values_of(values, block.path)[knob.key]
            got = getattr(args, knob.name)
            if knob.name == "kv_cache_memory":
                expected = settings.parse_bytes(expected)
            assert got == expected, (knob.flag, got, expected)
    # ... and into the data plane's config, as `pagedserve dataplane` builds it.
    config = dataplane_config_from_args(dp_args)
    flat = {
        f.name: getattr(section, f.name) for section in sections(config) for f in dataclasses.fields(section)
    }
    for knob in engine.knobs:
        expected = values["engine"][knob.key]
        assert flat[knob.name] == (
            settings.parse_bytes(expected) if knob.name == "kv_cache_memory" else expected
        )
    # The control planes tokenize with the data planes' model.
    assert cp_args.model == values["engine"]["model"]


def values_of(values: dict[str, Any], path: list[str]) -> dict[str, Any]:
    for part in path:
        values = values[part]
    return values


def sections(config: DataPlaneConfig) -> list[Any]:
    # Every section of the engine's config, however many there are (model, cache, scheduler, parallel...).
    return [getattr(config.engine, f.name) for f in dataclasses.fields(config.engine)]


def test_null_engine_values_leave_their_flags_out() -> None:
    objs = objects(render({"engine": {"maxModelLen": None, "blockSize": None}}))
    args = container(one(objs, "StatefulSet", "dataplane"), "dataplane")["args"]
    assert not [a for a in args if a.startswith(("--max-model-len", "--block-size"))]
    assert parse(args).block_size == 16  # the flag's default: the dataclass's


def test_every_engine_flag_is_a_chart_value_or_set_by_the_chart() -> None:
    engine = blocks()[0]
    names = {k.name for k in engine.knobs}
    flags = {
        f.name
        for section in sections(DataPlaneConfig())
        for f in dataclasses.fields(section)
        if f.metadata.get("cli", True)
    }
    assert flags - names == {n for n in flags if n in CHART_MANAGED} == {"model_home"}


# -- the value sets' own facts -------------------------------------------------------------------
def test_cpu_only_set() -> None:
    objs = rendered("cpu-only")
    sts = one(objs, "StatefulSet", "dataplane")
    dp = container(sts, "dataplane")
    assert sts["spec"]["replicas"] == 3
    assert "nvidia.com/gpu" not in str(dp["resources"]) and dp["image"].endswith(":0.1.0-cpu")
    args = parse(dp["args"])
    assert (args.device, args.num_threads, args.kv_cache_memory) == ("cpu", 4, 2**30)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "models" and claim["spec"]["storageClassName"] == "standard"
    assert "models" not in {v["name"] for v in pod_spec(sts)["volumes"]}
    dashboard = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_two_gpu_set() -> None:
    objs = rendered("two-gpus")
    sts = one(objs, "StatefulSet", "dataplane")
    spec = pod_spec(sts)
    dp = container(sts, "dataplane")
    assert sts["spec"]["replicas"] == 2
    assert dp["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert dp["image"].endswith(":0.1.0-cuda")
    assert container(one(objs, "Deployment", "controlplane"), "controlplane")["image"].endswith(
        ":0.1.0-controlplane"
    )
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu" and spec["runtimeClassName"] == "nvidia"
    args = parse(dp["args"])
    assert (args.device, args.dtype, args.kv_cache_dtype) == ("cuda", "bfloat16", "fp8_e4m3")
    assert (args.gpu_memory_utilization, args.max_model_len, args.block_size) == (0.85, 4096, 32)


def test_secure_set_mounts_every_file_its_flags_name() -> None:
    objs = rendered("secure")
    deployment = one(objs, "Deployment", "controlplane")
    sts = one(objs, "StatefulSet", "dataplane")
    cp_args = parse(container(deployment, "controlplane")["args"])
    dp_args = parse(container(sts, "dataplane")["args"])
    secret = next(o for o in of_kind(objs, "Secret") if o["metadata"]["name"] == f"{FULLNAME}-api-keys")
    assert mounted_file(deployment, "controlplane", cp_args.api_key_file) == (
        secret["metadata"]["name"],
        "api-keys",
    )
    assert base64.b64decode(secret["data"]["api-keys"]).decode().split() == ["key-one", "key-two"]
    expect = {
        cp_args.tls_cert_file: ("pagedserve-public-tls", "tls.crt"),
        cp_args.tls_key_file: ("pagedserve-public-tls", "tls.key"),
        cp_args.dataplane_tls_ca_file: ("pagedserve-controlplane-client-tls", "ca.crt"),
        cp_args.dataplane_tls_cert_file: ("pagedserve-controlplane-client-tls", "tls.crt"),
        cp_args.dataplane_tls_key_file: ("pagedserve-controlplane-client-tls", "tls.key"),
    }
    for path, source in expect.items():
        assert mounted_file(deployment, "controlplane", path) == source
    for path, source in {
        dp_args.tls_cert_file: ("pagedserve-dataplane-tls", "tls.crt"),
        dp_args.tls_key_file: ("pagedserve-dataplane-tls", "tls.key"),
        dp_args.tls_client_ca_file: ("pagedserve-dataplane-tls", "ca.crt"),
    }.items():
        assert mounted_file(sts, "dataplane", path) == source
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    monitors = {
        m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in of_kind(objs, "ServiceMonitor")
    }
    assert set(monitors) == {"controlplane", "dataplane"}
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (cp_endpoint,) = monitors["controlplane"]["spec"]["endpoints"]
    assert (cp_endpoint["port"], cp_endpoint["path"], cp_endpoint["scheme"]) == ("http", "/metrics", "https")
    (dp_endpoint,) = monitors["dataplane"]["spec"]["endpoints"]
    assert (dp_endpoint["port"], dp_endpoint["path"]) == (
        "metrics",
        "/metrics",
    ) and "scheme" not in dp_endpoint
    env = {e["name"]: e for e in container(sts, "dataplane")["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4317"
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"] == {
        "name": "otel-auth",
        "key": "headers",
    }
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"].endswith(",deployment.environment=prod")
    from pagedserve.common.telemetry import tracing_requested

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"])
        assert tracing_requested()


def test_default_set_has_no_tracing_no_monitor_no_autoscaler() -> None:
    objs = rendered("default")
    assert not list(of_kind(objs, "ServiceMonitor")) and not list(of_kind(objs, "HorizontalPodAutoscaler"))
    assert one(objs, "Deployment", "controlplane")["spec"]["replicas"] == 2
    for workload in workloads(objs):
        for c in pod_spec(workload)["containers"]:
            assert not [e for e in c["env"] if e["name"].startswith("OTEL_")]


def test_existing_pvc_set_mounts_the_claim_read_only_and_pulls_nothing() -> None:
    objs = rendered("existing-pvc")
    for workload in workloads(objs):
        spec = pod_spec(workload)
        assert "initContainers" not in spec
        assert "volumeClaimTemplates" not in workload["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        assert volume == {"name": "models", "persistentVolumeClaim": {"claimName": "llm-models"}}
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True
    cp_args = parse(container(one(objs, "Deployment", "controlplane"), "controlplane")["args"])
    assert cp_args.served_model_names == ["smol", "/models/llama-7b-hf"]


def test_pull_init_container_fills_the_store_the_server_reads() -> None:
    objs = rendered("default")
    for workload in workloads(objs):
        spec = pod_spec(workload)
        (init,) = spec["initContainers"]
        args = parse(init["args"])
        main = parse(spec["containers"][0]["args"])
        assert (args.models_command, args.name, args.model_home) == ("pull", main.model, main.model_home)
        (mount,) = [m for m in init["volumeMounts"] if m["name"] == "models"]
        assert not mount.get("readOnly") and mount["mountPath"] == main.model_home


# -- graceful rollout ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_data_planes_drain_in_a_pre_stop_hook_within_the_grace_period(name: str) -> None:
    objs = rendered(name)
    sts = one(objs, "StatefulSet", "dataplane")
    dp = container(sts, "dataplane")
    command = dp["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "python"
    source, key = mounted_file(sts, "dataplane", command[1])
    hooks = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == source)
    assert hooks["data"][key] == (CHART / "files" / "drain.py").read_text()
    hook_args = load_drain_script().parse_args(command[2:])
    assert hook_args.address == f"127.0.0.1:{parse(dp['args']).port}"
    grace = pod_spec(sts)["terminationGracePeriodSeconds"]
    assert 0 < hook_args.timeout < grace
    dp_args = parse(dp["args"])
    assert hook_args.token_file == dp_args.dataplane_token_file
    if hook_args.token_file:
        mounted_file(sts, "dataplane", hook_args.token_file)
    if hook_args.ca_file:
        assert mounted_file(sts, "dataplane", hook_args.ca_file)[1] == "ca.crt"
        assert hook_args.server_name.startswith("$POD_NAME.")
    cp = container(one(objs, "Deployment", "controlplane"), "controlplane")
    assert cp["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_notes_tell_how_to_call_the_service() -> None:
    notes = render({})["pagedserve/templates/NOTES.txt"]
    for needle in (
        f"port-forward svc/{CP_NAME} 50051:50051 8000:8000",
        "grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check",
        'base_url="http://127.0.0.1:8000/v1"',
        f"scale statefulset/{DP_NAME}",
    ):
        assert needle in notes
    secure = render(VALUE_SETS["secure"])["pagedserve/templates/NOTES.txt"]
    assert "Authorization: Bearer $PAGEDSERVE_API_KEY" in secure and "https://127.0.0.1:8000/v1" in secure
