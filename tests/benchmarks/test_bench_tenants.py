"""`pagedserve bench tenants` end to end on a tiny model, launched and in process: every
request of both tenants completes in every round, and the verdict is computed from the
rounds' own figures (the figures themselves are what the benchmark prints, not asserted)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagedserve.benchmarks import tenants
from pagedserve.benchmarks.report import Report


@pytest.mark.parametrize("in_process", [False, True], ids=["launched", "in-process"])
def test_bench_tenants_completes_every_request_of_both_tenants(tmp_path: Path, in_process: bool) -> None:
    parser = argparse.ArgumentParser()
    tenants.add_arguments(parser)
    args = parser.parse_args(["--flood", "12", "--victim", "3", "--repeat", "1", "--threads", "1"])
    args.in_process = in_process
    report = Report("tenants", tmp_path, ["pagedserve", "bench", "tenants"], progress=False)
    results = tenants.run(args, report)
    rounds = results["fair"]["rounds"]
    expected = {
        "a alone": {"a": 12},
        "a floods, b": {"a": 12, "b": 3},
        "a = b": {"a": 3, "b": 3},
    }
    assert {name: {t: f["requests"] for t, f in per.items()} for name, per in rounds.items()} == expected
    assert all(f["completed"] == f["requests"] for per in rounds.values() for f in per.values())
    assert all(
        f["tokens"] == f["requests"] * args.output_len for per in rounds.values() for f in per.values()
    )
    flood, equal, alone = rounds["a floods, b"], rounds["a = b"], rounds["a alone"]
    assert results["fair"]["b_ttft_p50_flood_over_equal"] == pytest.approx(
        flood["b"]["ttft_p50_ms"] / equal["b"]["ttft_p50_ms"]
    )
    assert results["fair"]["a_tokens_per_s_flood_over_alone"] == pytest.approx(
        flood["a"]["tokens_per_s"] / alone["a"]["tokens_per_s"]
    )
