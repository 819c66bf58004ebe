"""`pagedserve bench pressure` end to end on a tiny random Llama and a tiny workload: the
plumbing (three modes, one JSON, numbers where numbers belong), not the figures."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.cli import main


def test_pressure_reports_all_three_modes(tiny: Path, tmp_path: Path) -> None:
    # 8 chat-trace requests (KV demand ~1,400 tokens) on a 40-block (640-token) device pool
    argv = ["bench", "pressure", "--model", str(tiny), "--requests", "8", "--max-tokens", "16"]
    argv += ["--kv-cache-memory", "640KiB", "--max-num-seqs", "8", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "pressure.json").read_text())
    assert doc["benchmark"] == "pressure" and doc["tables"]
    modes = doc["modes"]
    assert list(modes) == ["recompute", "swap", "auto"]
    for name, m in modes.items():
        for key in (
            "recomputed_tokens",
            "recomputed_share",
            "blocks_swapped_out",
            "blocks_swapped_in",
            "output_tok_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "preemptions",
        ):
            assert isinstance(m[key], int | float), (name, key)
        assert m["output_tokens"] == doc["workload"]["output_tokens"]
        assert m["recomputed_tokens"] >= 0 and m["output_tok_s"] > 0
        assert m["same_greedy_tokens_as_recompute"] == 8  # fp32 greedy: the mode changes nothing
    assert modes["recompute"]["preemptions"] > 0  # the pool is small enough to force preemption
    assert modes["recompute"]["blocks_swapped_out"] == 0 and modes["recompute"]["recomputed_tokens"] > 0
    assert modes["swap"]["blocks_swapped_out"] > 0
    assert isinstance(doc["auto_over_recompute_throughput"], float)
    assert set(doc["goals"]) == {"auto_recomputed_share_below_5pct", "auto_beats_recompute_throughput"}


def test_no_preemption_means_nothing_recomputed(tiny: Path, tmp_path: Path) -> None:
    """The recomputed-token count is computed, not reported by the engine: on a pool that
    holds the whole workload it must come out exactly 0."""
    argv = ["bench", "pressure", "--model", str(tiny), "--requests", "4", "--max-tokens", "8"]
    argv += ["--kv-cache-memory", "8MiB", "--modes", "recompute", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    (m,) = json.loads((tmp_path / "pressure.json").read_text())["modes"].values()
    assert m["preemptions"] == 0 and m["recomputed_tokens"] == 0
