"""`pagedserve bench speculative` on a small run: its plan and the figures it records (not
their values): each workload's prompts, identical greedy outputs, valid JSON under a schema."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.benchmarks import speculative


def test_a_small_run_records_every_workload_and_method(default_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    argv = ["--model", str(default_model_path), "--streams", "2", "--max-tokens", "80"]
    argv += ["--workloads", "json", "--kv-cache-memory", "256MiB", "--json", str(out)]
    assert speculative.main(argv) == 0
    results = json.loads(out.read_text())
    runs = {(r["workload"], r["method"]): r for r in results["runs"]}
    assert set(runs) == {("json", m) for m in speculative.METHODS}
    for row in runs.values():
        assert row["streams"] == 2 and row["prompts"] == 2
        assert row["identical"] == 2  # greedy: drafting changes no token
        assert row["tokens"] > 0 and row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
    assert runs[("json", "ngram")]["valid_json"] == 2
    assert runs[("json", "ngram")]["drafted_tokens"] > 0  # a record copied from the prompt drafts
