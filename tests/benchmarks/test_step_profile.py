"""`pagedserve bench step-profile` end to end on a tiny random Llama with tiny steps: the
table's rows and columns, the JSON's keys, shares that add up; not the timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pagedserve.dataplane.models.attention as attention
import pagedserve.dataplane.models.llama as llama
import pagedserve.dataplane.runner.model_runner as model_runner
from pagedserve.benchmarks.step_profile import PHASES, VARIANTS
from pagedserve.cli import main


def test_step_profile_table_and_json(tiny: Path, tmp_path: Path) -> None:
    argv = ["bench", "step-profile", "--model", str(tiny), "--threads", "1", "--block-size", "4"]
    argv += ["--decode-seqs", "3", "--context", "9", "--prefill-seqs", "2", "--prefill-len", "7"]
    argv += ["--decode-steps", "2", "--prefill-steps", "1", "--decode-pairs", "2", "--prefill-pairs", "1"]
    patched = [(attention, "write_kv_cache"), (model_runner, "sample"), (llama, "rms_norm")]
    before = [getattr(module, name) for module, name in patched]
    threads = torch.get_num_threads()
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    # the profiling wrappers are gone, the thread count restored
    assert [getattr(module, name) for module, name in patched] == before
    assert torch.get_num_threads() == threads
    doc = json.loads((tmp_path / "step-profile.json").read_text())
    assert doc["benchmark"] == "step-profile"
    assert doc["owned_layers"] == 2  # both tiny Llama layers run on the owned model in the "owned" runner
    assert doc["steps"]["decode"]["rows"] == 3 and doc["steps"]["prefill"]["rows"] == 14

    profile_table, ab_table = doc["tables"]
    assert profile_table["header"] == [
        "op class",
        "decode 3 x 9, transformers layers",
        "decode 3 x 9, owned layers",
        "prefill 2 x 7, transformers layers",
        "prefill 2 x 7, owned layers",
    ]
    assert [r[0] for r in profile_table["rows"]] == [*PHASES.values(), "**step**"]
    assert [r[:2] for r in ab_table["rows"]] == [["decode 3 x 9", "2"], ["prefill 2 x 7", "1"]]

    for cls in ("decode", "prefill"):
        for variant in VARIANTS:
            p = doc["profile"][cls][variant]
            assert list(p["phases"]) == list(PHASES)
            assert p["step_ms"] > 0
            # every labelled range fired in both variants and both step classes
            for key in PHASES.keys() - {"other"}:
                assert p["phases"][key]["ms"] > 0, (cls, variant, key)
            assert sum(ph["share"] for ph in p["phases"].values()) == pytest.approx(1.0, abs=1e-6)
            assert sum(ph["ms"] for ph in p["phases"].values()) == pytest.approx(p["step_ms"])
        a = doc["ab"][cls]
        assert set(a["median_ms"]) == set(VARIANTS) and a["speedup"] > 0


def test_bad_sizes_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag, value, message in (("--context", "1", ">= 2"), ("--prefill-pairs", "0", ">= 1")):
        assert main(["bench", "step-profile", flag, value, "--out", str(tmp_path), "--no-progress"]) != 0
        assert f"{flag} must be {message}, got {value}" in capsys.readouterr().err
    assert not (tmp_path / "step-profile.json").exists()


def test_profile_runs_the_block_ops_halves_op_by_op_and_restores_them(tiny: Path) -> None:
    """The C++ block ops hide the phases inside them: the profiled steps run each layer half
    op by op, and the runner gets its block ops back after."""
    from pagedserve.benchmarks.step_profile import build_runner, phase_ranges
    from pagedserve.dataplane.models import LlamaDecoderLayer

    runner = build_runner(tiny, True, 16, 4)
    layers = [m for m in runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
    bound = [(layer.attention_input_args, layer.mlp_args) for layer in layers]
    assert len(layers) == 2 and all(a is not None and m is not None for a, m in bound)
    with phase_ranges(runner):
        assert all(layer.attention_input_args is None and layer.mlp_args is None for layer in layers)
    assert [(layer.attention_input_args, layer.mlp_args) for layer in layers] == bound
