"""`pagedserve bench priority` end to end on a tiny random Llama: a priority-0 request on a pool
full of priority-10 streams preempts one of them in both modes, gets its first token in its
first step, and every stream finishes with the greedy tokens of its unpreempted run; the pool
ends free. The timings are printed, not asserted."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.cli import main


def test_priority_preempts_once_and_the_streams_keep_their_tokens(tiny: Path, tmp_path: Path) -> None:
    argv = ["bench", "priority", "--model", str(tiny), "--streams", "4", "--prompt-len", "16"]
    argv += ["--max-tokens", "32", "--urgent-prompt-len", "16", "--threads", "1", "--repeat", "1"]
    argv += ["--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "priority.json").read_text())
    assert [m["mode"] for m in doc["modes"]] == ["swap", "recompute"]
    for m in doc["modes"]:
        assert m["pool_blocks"] == 4 * 3  # (16 + 32) tokens in blocks of 16, per stream
        assert m["free_blocks_at_arrival"] == 0  # it arrived at a full pool ...
        assert m["priority_preemptions"] == m["preemptions"] == 1  # ... and took one stream's blocks
        assert m["urgent_ttft_steps"] == 1
        assert m["streams_same_greedy_tokens"] == m["streams"] == 4
        assert m["pool_free_after"] is True
