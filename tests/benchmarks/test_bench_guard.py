"""`pagedserve bench guard` end to end on a tiny model: a launched `serve`, the guard stream
and three hostile cases in processes of their own. Figures are not asserted (that is what the
benchmark prints); what is: every case ran its rounds against the server, the guard's gaps
were measured in each, and every guard request gave the same greedy tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedserve.benchmarks import guard
from pagedserve.benchmarks.report import Report


def test_bench_guard_runs_the_cases_beside_an_unchanged_guard_stream(tiny: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny),
        threads=1,
        cases=["halfclose", "stopids", "burst"],
        rounds=2,
        guard_tokens=16,
        settle=0.5,
        serve_args=["--prefill-stretch", "1", "--kv-cache-memory", "64MiB"],
    )
    report = Report("guard", tmp_path, ["pagedserve", "bench", "guard"], progress=False)
    results = guard.run(args, report)
    report.finish(results)
    cases = {c["case"]: c for c in results["cases"]}
    assert list(cases) == ["halfclose", "stopids", "burst"]
    for case in cases.values():
        assert case["gaps"] > 0
        assert 0 < case["median_gap_ms"] <= case["longest_gap_ms"]
        assert case["ratio"] == case["longest_gap_ms"] / case["median_gap_ms"]
    assert [r.split(":")[0] for r in cases["halfclose"]["rounds"]] == ["round 0", "round 1"]
    # gRPC refuses the 6 MB message before the server reads it
    assert cases["stopids"]["rounds"] == ["round 0: RESOURCE_EXHAUSTED", "round 1: RESOURCE_EXHAUSTED"]
    assert cases["burst"]["rounds"] == [cases["burst"]["rounds"][0]]  # once, whatever --rounds says
    assert cases["burst"]["rounds"][0].startswith("round 0: 1000 ended in ")
    assert results["guard_requests"] >= 3
    assert results["guard_identical"] == results["guard_requests"]
    saved = json.loads((tmp_path / "guard.json").read_text())
    assert saved["guard_identical"] == results["guard_identical"]
