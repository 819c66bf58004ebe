"""Prometheus metrics on both planes: the exposition passes `promtool check metrics`, and the
values move as a scripted workload runs (tiny model, real servers)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.clients.python import AsyncGenerationClient
from tests.e2e.harness import ServerThread, engine_config


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    # 8 blocks of 16 tokens: two requests growing to 96 tokens each must preempt.
    srv = ServerThread(engine_config(tiny, num_blocks=8, max_model_len=128), tiny)
    yield srv
    srv.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("PAGEDSERVE_REQUIRE_PROMTOOL"):
            pytest.fail("promtool not found: apt-get install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def scrape_controlplane(server: ServerThread) -> str:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain")
        return response.read().decode()


def test_metrics_move_with_a_scripted_workload_and_pass_promtool(server: ServerThread) -> None:
    dp_registry = server.dataplane.loop.metrics.registry
    address = server.dataplane.address
    before_cp = samples(scrape_controlplane(server))
    before_dp = samples(generate_latest(dp_registry).decode())
    assert value(before_cp, "pagedserve_dataplane_up", dataplane=address) == 1.0
    assert (
        value(
            before_dp,
            "pagedserve_cache_config_info",
            block_size="16",
            enable_prefix_caching="true",
            kv_cache_dtype="auto",
            num_gpu_blocks="8",
        )
        == 1.0
    )

    shared = list(range(10, 42))  # two full blocks

    async def workload() -> None:
        async with AsyncGenerationClient(server.grpc_address) as client:
            await client.generate([*shared, 5], max_tokens=4, temperature=0.0)
            await client.generate([*shared, 6], max_tokens=4, temperature=0.0)  # 32 prompt tokens cached
            # Two requests that outgrow the 8-block pool together: one is preempted.
            await asyncio.gather(
                client.generate([7] * 16, max_tokens=80, ignore_eos=True, temperature=0.0),
                client.generate([8] * 16, max_tokens=80, ignore_eos=True, temperature=0.0),
            )
            with pytest.raises(grpc.aio.AioRpcError):
                await client.generate([5], max_tokens=4, temperature=-1.0)

    server._run(workload())
    server.wait_idle()
    cp_text = scrape_controlplane(server)
    dp_text = generate_latest(dp_registry).decode()
    promtool_check(cp_text)
    promtool_check(dp_text)
    cp, dp = samples(cp_text), samples(dp_text)

    def delta(m: dict, b: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
        return value(m, name, **labels) - value(b, name, **labels)

    for m, b in ((cp, before_cp), (dp, before_dp)):
        assert delta(m, b, "pagedserve_request_success_total", finished_reason="length") == 4
        assert delta(m, b, "pagedserve_generation_tokens_total") == 4 + 4 + 80 + 80
        assert delta(m, b, "pagedserve_prompt_tokens_total") == 33 + 33 + 16 + 16
        assert delta(m, b, "pagedserve_time_to_first_token_seconds_count") == 4
        assert delta(m, b, "pagedserve_e2e_request_latency_seconds_count") == 4
        assert delta(m, b, "pagedserve_time_per_output_token_seconds_count") == 4
    assert delta(cp, before_cp, "pagedserve_request_failure_total", code="INVALID_ARGUMENT") == 1
    assert delta(cp, before_cp, "pagedserve_inter_token_latency_seconds_count") == 3 + 3 + 79 + 79
    assert delta(cp, before_cp, "pagedserve_request_queue_time_seconds_count") == 4
    assert delta(dp, before_dp, "pagedserve_prefix_cache_hits_total") == 32
    assert delta(cp, before_cp, "pagedserve_prefix_cache_hits_total", dataplane=address) == 32
    assert delta(dp, before_dp, "pagedserve_num_preemptions_total") >= 1
    assert value(cp, "pagedserve_num_preemptions_total", dataplane=address) == value(
        dp, "pagedserve_num_preemptions_total"
    )
    # Idle again: nothing in use, nothing running.
    assert value(dp, "pagedserve_kv_cache_usage_perc") == 0.0
    assert value(cp, "pagedserve_kv_cache_usage_perc", dataplane=address) == 0.0
    assert value(dp, "pagedserve_num_requests_running") == 0.0
    assert 0 < value(dp, "pagedserve_prefix_cache_hit_rate") < 1


def test_dataplane_serves_metrics_over_http(tmp_path: Path) -> None:
    from tests.e2e.harness import Process

    tiny = make_tiny_model("llama", tmp_path / "llama")
    proc = Process(
        [
            "dataplane",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--model",
            str(tiny),
            "--num-gpu-blocks-override",
            "8",
        ],
        "metrics on ",
    )
    try:
        with urllib.request.urlopen(proc.address, timeout=10) as response:
            text = response.read().decode()
        assert value(samples(text), "pagedserve_kv_cache_free_blocks") == 8.0
        promtool_check(text)
    finally:
        proc.kill()
