"""`pagedserve doctor`: the seed's tuning rules on synthetic samples, then against a live
server whose small pool forces preemptions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.python import AsyncGenerationClient
from controlplane.doctor import Sample, Thresholds, diagnose, parse
from pagedserve.cli import main
from tests.e2e.harness import ServerThread, engine_config
from tests.tiny_models import make_tiny_model


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
    assert finding.numbers == {"preemptions": 10, "finished": 50}  # 20% during the window
    quiet = [{"a": Sample(preemptions=3, finished=100)}, {"a": Sample(preemptions=3, finished=100)}]
    assert diagnose(quiet) == []  # 3% since start
    assert diagnose(quiet, Thresholds(preemption_ratio=0.01))[0].rule == "preemptions"


def test_parse_reads_both_expositions() -> None:
    cp = """# TYPE pagedserve_kv_cache_usage_perc gauge
pagedserve_kv_cache_usage_perc{dataplane="10.0.0.1:50052"} 0.5
# TYPE pagedserve_dataplane_finished_requests counter
pagedserve_dataplane_finished_requests_total{dataplane="10.0.0.1:50052"} 7
# TYPE pagedserve_request_success counter
pagedserve_request_success_total{finished_reason="stop"} 7
"""
    assert parse(cp) == {"10.0.0.1:50052": Sample(kv_usage=0.5, finished=7)}
    dp = """# TYPE pagedserve_num_preemptions counter
pagedserve_num_preemptions_total 2
# TYPE pagedserve_request_success counter
pagedserve_request_success_total{finished_reason="stop"} 3
pagedserve_request_success_total{finished_reason="length"} 4
"""
    assert parse(dp) == {"": Sample(preemptions=2, finished=7)}


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
    assert "[prefix_hit_rate]" in out  # unrelated prompts: nothing to reuse
    assert main(["doctor", "--url", "http://127.0.0.1:9", "--samples", "1"]) == 2
