"""`pagedserve doctor`: its tuning rules of thumb on synthetic samples, then against a live
server whose small pool forces preemptions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from pagedserve.benchmarks.tiny_models import make_tiny_model
from pagedserve.cli import main
from pagedserve.clients.python import AsyncGenerationClient
from pagedserve.controlplane.doctor import Sample, Thresholds, diagnose, parse
from pagedserve.controlplane.metrics import ControlPlaneMetrics
from pagedserve.dataplane.engine.outputs import EngineStats
from pagedserve.dataplane.kvcache import PrefixCacheStats
from pagedserve.dataplane.server.protocol import pool_stats_to_proto
from pagedserve.protos.pagedserve.v1 import dataplane_pb2
from tests.e2e.harness import ServerThread, engine_config


def test_sustained_high_usage_is_flagged_but_a_spike_is_not() -> None:
    high = [{"a": Sample(kv_usage=u)} for u in (0.95, 0.97, 0.93)]
    (finding,) = diagnose(high, window_s=4)
    assert finding.rule == "kv_usage" and finding.dataplane == "a"
    assert finding.numbers["min_usage"] == pytest.approx(0.93)
    assert "--max-num-seqs" in finding.message and "in all 3 samples" in finding.message
    spike = [{"a": Sample(kv_usage=u)} for u in (0.95, 0.50, 0.97)]
    assert diagnose(spike) == []


def test_low_hit_rate_needs_enough_queries() -> None:
    low = [{"": Sample(prefix_queries=5000, prefix_hits=1000)}]
    (finding,) = diagnose(low)
    assert finding.rule == "prefix_hit_rate" and finding.numbers["hit_rate"] == pytest.approx(0.2)
    assert "--no-enable-prefix-caching" in finding.message
    assert diagnose([{"": Sample(prefix_queries=500, prefix_hits=0)}]) == []  # too little evidence
    assert diagnose([{"": Sample(prefix_queries=5000, prefix_hits=2000)}]) == []


def test_preemptions_over_the_window_or_since_start() -> None:
    window = [{"a": Sample(preemptions=10, finished=100)}, {"a": Sample(preemptions=20, finished=150)}]
    (finding,) = diagnose(window)
    assert finding.numbers["preemptions"] == 10 and finding.numbers["finished"] == 50  # 20% in the window
    quiet = [{"a": Sample(preemptions=3, finished=100)}, {"a": Sample(preemptions=3, finished=100)}]
    assert diagnose(quiet) == []  # 3% since start
    assert diagnose(quiet, Thresholds(preemption_ratio=0.01))[0].rule == "preemptions"


def test_parse_reads_both_expositions() -> None:
    cp = """# TYPE pagedserve_kv_cache_usage_perc gauge
pagedserve_kv_cache_usage_perc{dataplane="10.0.0.1:50052"} 0.5
# TYPE pagedserve_request_success counter
pagedserve_request_success_total{finished_reason="stop"} 4
pagedserve_request_success_total{finished_reason="length"} 3
"""
    assert parse(cp) == {"10.0.0.1:50052": Sample(kv_usage=0.5, finished=7)}
    dp = """# TYPE pagedserve_num_preemptions counter
pagedserve_num_preemptions_total 2
# TYPE pagedserve_request_success counter
pagedserve_request_success_total{finished_reason="stop"} 3
pagedserve_request_success_total{finished_reason="length"} 4
"""
    assert parse(dp) == {"": Sample(preemptions=2, finished=7)}


def test_doctor_reads_finished_requests_from_what_a_control_plane_exports() -> None:
    """Issue 12: the doctor read `pagedserve_dataplane_finished_requests_total`, which no
    control plane exports, and printed `finished 0` for every data plane. It reads the
    control plane's real exposition now (its finished completions, all data planes)."""
    links = {
        address: SimpleNamespace(
            address=address,
            info=dataplane_pb2.DataPlaneInfo(num_blocks=100, block_size=16),
            stats=dataplane_pb2.PoolStats(total_blocks=100, free_blocks=25, num_preemptions=preempted),
            budget=SimpleNamespace(reserved_blocks=0),
            healthy=True,
        )
        for address, preempted in (("10.0.0.1:50052", 3), ("10.0.0.2:50052", 0))
    }
    metrics = ControlPlaneMetrics(SimpleNamespace(connections=links, admission=()))
    for reason in ("stop", "length", "stop", "abort"):
        metrics.completion(reason, 5, 3, 0.1, 0.2, first_of_request=True)
    exposition = generate_latest(metrics.registry).decode()
    assert "dataplane_finished_requests" not in exposition
    assert parse(exposition) == {
        "10.0.0.1:50052": Sample(kv_usage=0.75, preemptions=3, finished=4),
        "10.0.0.2:50052": Sample(kv_usage=0.75, finished=4),
    }


def test_recomputes_with_a_free_host_pool_suggest_swap_mode() -> None:
    free = [
        {
            "a": Sample(
                preemptions=12,
                preemptions_swap=2,
                preemptions_recompute=10,
                finished=40,
                host_total_blocks=64,
                host_free_blocks=60,
                host_usage=4 / 64,
            )
        }
    ]
    pre, mode = diagnose(free)
    assert pre.rule == "preemptions" and pre.numbers == {
        "preemptions": 12,
        "finished": 40,
        "swap": 2,
        "recompute": 10,
    }
    assert pre.message == (
        "12 preemptions for 40 finished requests since start (30.0% > 5%; 2 swap, 10 recompute): requests are "
        "being swapped out or recomputed; give the KV cache more memory (--kv-cache-memory / "
        "--gpu-memory-utilization) or lower --max-num-seqs"
    )
    assert mode.rule == "preemption_mode" and mode.message == (
        "10 of 12 preemptions since start recomputed their requests while the host (swap) pool was at most 6% "
        "full (64 blocks): recompute re-does the victims' tokens where a swap would copy their blocks; try "
        "--preemption-mode swap"
    )
    no_pool = [{"a": Sample(preemptions=10, preemptions_recompute=10, finished=40)}]
    assert diagnose(no_pool)[1].message == (
        "10 of 10 preemptions since start recomputed their requests and there is no host (swap) pool: recompute "
        "re-does every victim's tokens; give it one with --swap-space (GiB) and --preemption-mode auto"
    )
    # mostly swaps, or a host pool that is full anyway: no advice to swap more
    swaps = [
        {
            "a": Sample(
                preemptions=12,
                preemptions_swap=8,
                preemptions_recompute=4,
                finished=40,
                host_total_blocks=64,
                host_free_blocks=60,
                host_usage=4 / 64,
            )
        }
    ]
    assert [f.rule for f in diagnose(swaps)] == ["preemptions"]
    # over the window: 6 recomputes for 50 finished requests (12%), none since the first sample's 10
    window = [
        {"a": Sample(preemptions=10, preemptions_recompute=10, finished=100, host_total_blocks=8)},
        {"a": Sample(preemptions=16, preemptions_recompute=16, finished=150, host_total_blocks=8)},
    ]
    assert diagnose(window)[1].numbers == {"recompute": 6, "swap": 0, "max_host_usage": 0.0}


def test_a_host_pool_often_full_suggests_more_swap_space() -> None:
    def at(usage: float) -> dict[str, Sample]:
        return {"a": Sample(host_usage=usage, host_total_blocks=100, host_free_blocks=100 * (1 - usage))}

    (finding,) = diagnose([at(0.95), at(0.50), at(0.97)], window_s=4)
    assert finding.rule == "host_pool" and finding.message == (
        "host (swap) pool above 90% full in 2 of 3 samples (max 97.0% of 100 blocks): swap-outs that do not fit "
        "fall back to recompute; raise --swap-space"
    )
    assert diagnose([at(0.95), at(0.50), at(0.40)]) == []  # once in three: not often
    assert diagnose([{"a": Sample(host_usage=0.0)}]) == []  # no host pool, nothing to raise


def test_swap_stats_reach_the_doctor_from_both_expositions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The data plane's PoolStats (GetState) swap fields, mirrored per data plane on the
    control plane's /metrics, parsed back and printed, one line each."""
    engine_stats = EngineStats(
        total_blocks=100, free_blocks=10, cached_blocks=0, token_usage=0.9, num_running=0, num_waiting=0,
        num_preemptions=12, prefix_cache=PrefixCacheStats(), num_swapped=1, num_preemptions_swap=2,
        num_preemptions_recompute=10, blocks_swapped_out=30, blocks_swapped_in=24, swap_seconds=0.25,
        host_total_blocks=64, host_free_blocks=58,
    )  # fmt: skip
    stats = pool_stats_to_proto(engine_stats, draining=False, num_aborted=0)  # what GetState carries
    assert (stats.num_preemptions_swap, stats.num_preemptions_recompute) == (2, 10)
    assert (stats.blocks_swapped_out, stats.blocks_swapped_in, stats.swap_seconds) == (30, 24, 0.25)
    assert (stats.num_swapped, stats.host_total_blocks, stats.host_free_blocks) == (1, 64, 58)
    link = SimpleNamespace(
        address="10.0.0.1:50052",
        info=dataplane_pb2.DataPlaneInfo(num_blocks=100, block_size=16),
        stats=stats,
        budget=SimpleNamespace(reserved_blocks=0),
        healthy=True,
    )
    metrics = ControlPlaneMetrics(SimpleNamespace(connections={link.address: link}, admission=()))
    for _ in range(40):
        metrics.completion("length", 5, 3, 0.1, 0.2, first_of_request=True)
    parsed = parse(generate_latest(metrics.registry).decode())
    expected = Sample(
        kv_usage=0.9, preemptions=12, finished=40, preemptions_swap=2, preemptions_recompute=10,
        blocks_swapped_out=30, blocks_swapped_in=24, swap_seconds=0.25, swapped=1,
        host_usage=pytest.approx(6 / 64), host_total_blocks=64, host_free_blocks=58,
    )  # fmt: skip
    assert parsed == {"10.0.0.1:50052": expected}
    dp = """# TYPE pagedserve_num_preemptions_by_mode counter
pagedserve_num_preemptions_by_mode_total{mode="swap"} 3
pagedserve_num_preemptions_by_mode_total{mode="recompute"} 1
# TYPE pagedserve_kv_blocks_swapped_out counter
pagedserve_kv_blocks_swapped_out_total 12
# TYPE pagedserve_cpu_kv_cache_total_blocks gauge
pagedserve_cpu_kv_cache_total_blocks 32
"""
    assert parse(dp) == {"": Sample(preemptions_swap=3, preemptions_recompute=1, blocks_swapped_out=12,
                                    host_total_blocks=32)}  # fmt: skip

    monkeypatch.setattr("pagedserve.controlplane.doctor.scrape", lambda url: parsed)
    assert main(["doctor", "--url", "http://cp:8000", "--samples", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "10.0.0.1:50052: KV usage 90.0%, running 0, waiting 0, prefix hit rate 0.0% of 0 tokens, preemptions 12, "
        "finished 40 (all data planes, as the control plane counts them)",
        "  preemptions by mode: swap 2, recompute 10; blocks swapped out 30, in 24 (0.250 s copying); "
        "swapped now 1; host pool 6 of 64 blocks in use (9.4%)",
    ]
    assert [line.split("]")[0] + "]" for line in lines[2:]] == ["[preemptions]", "[preemption_mode]"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tiny: Path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    srv = ServerThread(engine_config(tiny, num_blocks=8, max_model_len=128), tiny)
    yield srv
    srv.close()


def test_doctor_against_a_live_server(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--url", server.http_url, "--samples", "1"]) == 0
    assert "no findings" in capsys.readouterr().out

    async def overload() -> None:
        async with AsyncGenerationClient(server.grpc_address) as client:
            for i in range(3):  # pairs that outgrow the 8-block pool together: preemptions
                await asyncio.gather(
                    client.generate([7 + i] * 16, max_tokens=80, ignore_eos=True, temperature=0.0),
                    client.generate([50 + i] * 16, max_tokens=80, ignore_eos=True, temperature=0.0),
                )

    server._run(overload())
    code = main(["doctor", "--url", server.http_url, "--samples", "1", "--min-prefix-queries", "50"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"[preemptions] {server.dataplane.address}:" in out
    # 6 completions finished through the control plane (before: "finished 0", always)
    assert "finished 6 (all data planes, as the control plane counts them)" in out
    assert "preemptions for 6 finished requests" in out
    assert "[prefix_hit_rate]" in out  # unrelated prompts: nothing to reuse
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--samples", "1"]) == 2


def test_the_data_plane_exports_its_cpu_and_kernels(server: ServerThread) -> None:
    """The live data plane's exposition names its CPU, kernel build and each linear's kernel,
    and the doctor reads them (tiny layers are below the timing size: panel, untimed)."""
    from pagedserve.controlplane.doctor import kernels_line
    from pagedserve.kernels.cpu_isa import cpu_report

    exposition = generate_latest(server.dataplane.loop.metrics.registry).decode()
    (sample,) = parse(exposition).values()
    cpu = cpu_report()
    assert sample.kernels["isa"] == cpu["kernel_isa"] and sample.kernels["native_isa"] == cpu["native_isa"]
    assert sample.kernels["flags"] == " ".join(cpu["flags"])
    choices = server.dataplane.loop.engine.runner.linear_choices
    assert choices and {c.choice for c in choices.values()} == {"panel"}
    assert sample.kernels["linear"] == " ".join(f"{i}x{o}=panel" for i, o in choices)
    line = kernels_line(sample.kernels)
    assert line.startswith(f"cpu: {cpu['model']}; flags ") and f"kernels {cpu['kernel_isa']}" in line
