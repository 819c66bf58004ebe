"""benchmarks/src/pagedserve/benchmarks/gpu_check.sh on a machine without a GPU: the dry run passes and writes nothing, a
real run refuses, and the pieces that judge a GPU run's output (greedy comparison with ties,
step summaries, the engine's memory-plan log lines) work on canned inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.benchmarks import gpu_check
from pagedserve.benchmarks.gpu_check import (
    STEPS,
    TIME_BUDGET_S,
    Step,
    check_step_arguments,
    memory_plans,
    parse_args,
    plan,
    summarize,
    wheels_needed,
)
from pagedserve.benchmarks.gpu_steps import compare_greedy, exactness_ok

ROOT = Path(__file__).resolve().parents[2]
PYTEST_COLLECT = (sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def test_dry_run_prints_the_plan_checks_it_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmarks/src/pagedserve/benchmarks/gpu_check.sh", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for step in STEPS:
        assert f"| {step} " in proc.stdout
    assert "tests/kernels/test_triton_kernels.py" in proc.stdout
    assert "--seqs 32 --context 4096" in proc.stdout
    assert "time limits add up to 450 s (budget 480 s)" in proc.stdout
    assert "1.236B parameters" in proc.stdout
    assert proc.stdout.rstrip().endswith("dry run: OK; nothing ran on a GPU")
    assert not out.exists()


@no_cuda
def test_a_real_run_without_cuda_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--only", "attention", "--out", str(tmp_path / "out")]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_fits_the_budget_and_requires_cuda_for_the_kernel_tests(tmp_path: Path) -> None:
    steps = plan(parse_args([]), tmp_path)
    assert [s.name for s in steps] == list(STEPS)
    assert sum(s.limit_s for s in steps) <= TIME_BUDGET_S
    assert steps[0].env == {"PAGEDSERVE_KERNEL_TESTS": "cuda"}
    assert [s.name for s in plan(parse_args(["--only", "attention", "kernels"]), tmp_path)] == [
        "kernels",
        "attention",
    ]
    throughput = steps[-1].argv
    assert "--max-num-seqs=128" in throughput and "--peer-batch-size=64" in throughput
    assert all(check_step_arguments(s) == [] for s in steps)


def test_a_step_with_bad_arguments_is_a_problem() -> None:
    bad = Step(
        "attention", "", 1, ("python", "-m", "pagedserve.benchmarks.attention_kernels", "--seqs", "many")
    )
    assert check_step_arguments(bad) == [f"attention: its arguments do not parse: {list(bad.argv[1:])}"]
    missing = Step("kernels", "", 1, ("python", "-m", "pytest", "tests/kernels/test_absent.py"))
    assert check_step_arguments(missing) == ["kernels: no such test file ['tests/kernels/test_absent.py']"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--min-output", "9", "--max-output", "8"], "need --min-prompt <= --max-prompt"),
        (["--step", "exactness"], "--step needs --step-json"),
    ],
)
def test_bad_arguments_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_wheels_supply_pure_python_modules_only() -> None:
    assert wheels_needed(["structlog", "torch", "pytest"]) == [
        "structlog",
        "pytest",
        "iniconfig",
        "pluggy",
        "packaging",
    ]


def test_kernel_tests_refuse_to_fall_back_to_the_interpreter() -> None:
    def collect(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PAGEDSERVE_KERNEL_TESTS": value}
        return subprocess.run(
            [*PYTEST_COLLECT, "tests/kernels/test_cpu_fp8.py"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    bad = collect("gpu")
    assert bad.returncode != 0
    assert "PAGEDSERVE_KERNEL_TESTS must be 'cuda' or unset, got 'gpu'" in bad.stdout + bad.stderr
    if not torch.cuda.is_available():
        cuda = collect("cuda")
        assert cuda.returncode != 0
        assert "PAGEDSERVE_KERNEL_TESTS=cuda, but torch sees no CUDA device" in cuda.stdout + cuda.stderr


# -- judging a run's output ------------------------------------------------------------------------
def logits(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def test_compare_greedy_accepts_only_ties_with_the_runner_up() -> None:
    ref = [3, 1]
    # Step 1: the reference's top two (ids 1 and 2) are 10.0 and 10.0005 apart by 5e-4.
    scores = [logits(0, 0, 0, 9), logits(0, 10.0005, 10.0, 0)]
    assert compare_greedy([3, 1], ref, scores, 1e-4) == "exact"
    assert compare_greedy([3, 2], ref, scores, 1e-4) == "tie"  # 5e-4 < 1e-4 x 10.0005
    # A margin of 0.2 is no tie in fp32 (tolerance 1e-3) but is one at bf16's (0.306).
    wide = [logits(0, 0, 0, 9), logits(0, 10.2, 10.0, 0)]
    assert compare_greedy([3, 2], ref, wide, 1e-4).startswith("token 1: ours 2, reference 1, margin 0.2")
    assert compare_greedy([3, 2], ref, wide, 3e-2) == "tie"
    # Not even the runner-up: never a tie, whatever the margin.
    assert compare_greedy([3, 0], ref, scores, 1e-4).startswith("token 1: ours 0, reference 1")
    assert compare_greedy([3], ref, scores, 1e-4) == "length 1 != reference 2"


def exactness_case(
    dtype: str, exact: int, ties: int, mismatches: list[str], leaked: int = 0
) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "case": "batched",
        "prompts": 32,
        "exact": exact,
        "ties": ties,
        "mismatches": mismatches,
        "leaked_blocks": leaked,
    }


def test_exactness_passes_on_rare_ties_only() -> None:
    assert exactness_ok(
        {"cases": [exactness_case("float32", 30, 2, []), exactness_case("bfloat16", 24, 8, [])]}
    )
    assert not exactness_ok({"cases": [exactness_case("float32", 29, 3, [])]})  # too many ties in fp32
    assert not exactness_ok({"cases": [exactness_case("bfloat16", 31, 0, ["token 3: ..."])]})
    assert not exactness_ok({"cases": [exactness_case("float32", 32, 0, [], leaked=1)]})


def test_summaries_of_each_step(tmp_path: Path) -> None:
    (tmp_path / "kernels.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="53" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    assert summarize("kernels", tmp_path) == (
        "50 passed, 1 failed, 2 skipped",
        {"tests": 53, "failures": 1, "errors": 0, "skipped": 2},
    )
    exactness = {"cases": [exactness_case("bfloat16", 30, 2, [])]}
    attention = {
        "rows": [
            {"case": "triton bfloat16 cache", "gbps": 3600.0, "pct_datasheet": 75.0, "pct_copy_bw": 83.7},
            {"case": "triton fp8_e4m3 cache", "gbps": 3360.0, "pct_datasheet": 70.0, "pct_copy_bw": 78.1},
            {"case": "torch gather+SDPA bfloat16", "error": "out of memory"},
        ],
        "fp8_speedup_vs_16bit": 1.87,
    }
    throughput = {
        "engine": {"output_tok_s": 9000.0},
        "transformers_static": {"output_tok_s": 3000.0, "batch_size": 64},
        "speedup": 3.0,
    }
    for name, data in (("exactness", exactness), ("attention", attention), ("throughput", throughput)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    assert (
        summarize("exactness", tmp_path)[0] == "bfloat16 batched: 30/32 exact, 2 ties, 0 mismatches, 0 leaked"
    )
    assert summarize("attention", tmp_path)[0] == (
        "triton bfloat16 cache: 3600 GB/s = 75.0% of datasheet (83.7% of copy); "
        "triton fp8_e4m3 cache: 3360 GB/s = 70.0% of datasheet (78.1% of copy); "
        "torch gather+SDPA bfloat16: out of memory; FP8 1.87x faster than 16-bit"
    )
    assert summarize("throughput", tmp_path)[0] == (
        "engine 9000 tok/s vs transformers static batch 64 3000 tok/s: 3.00x"
    )
    assert summarize("throughput", tmp_path / "absent") == ("no throughput.json", {})


def test_memory_plans_are_read_from_a_steps_log(tmp_path: Path) -> None:
    plan_line = {"total": 150, "activation_peak": 7, "blocks": 12, "event": "gpu_memory_planned"}
    log = tmp_path / "exactness.log"
    log.write_text(
        "Loading weights: 100%\n"
        + json.dumps({"event": "kv_cache_planned", "blocks": 12})
        + "\n"
        + json.dumps(plan_line)
        + "\n"
    )
    assert memory_plans(log) == [plan_line]
    assert memory_plans(tmp_path / "absent.log") == []


def test_a_run_tabulates_every_step_and_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real run's bookkeeping with stand-in steps (no GPU): one passes with its figures and a
    memory-plan log line, one overruns its limit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    out = tmp_path / "out"
    figures = {"cases": [exactness_case("float32", 32, 0, [])]}
    plan_line = {"event": "gpu_memory_planned", "blocks": 9, "kv_bytes": 2**30, "activation_peak": 2**20}
    write = (
        "import json, pathlib; "
        f"pathlib.Path({str(out / 'exactness.json')!r}).write_text(json.dumps({figures!r})); "
        f"print(json.dumps({plan_line!r}))"
    )
    steps = [
        Step("exactness", "stand-in", 60, (sys.executable, "-c", write)),
        Step(
            "throughput", "stand-in that overruns", 1, (sys.executable, "-c", "import time; time.sleep(30)")
        ),
    ]
    assert gpu_check.run_all(parse_args(["--out", str(out)]), steps, out) == 1
    printed = capsys.readouterr().out
    assert "## GPU check on NVIDIA Test GPU" in printed
    assert "| exactness  | PASS    |" in printed
    assert "float32 batched: 32/32 exact, 0 ties, 0 mismatches, 0 leaked" in printed
    assert "| throughput | TIMEOUT |" in printed
    assert "memory plan: 9 blocks, KV 1.00 GiB, activation peak 1 MiB" in printed
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["device"] == "NVIDIA Test GPU"
    assert [(s["name"], s["status"]) for s in doc["steps"]] == [
        ("exactness", "PASS"),
        ("throughput", "TIMEOUT"),
    ]
    assert doc["steps"][0]["data"] == figures
    assert doc["memory_plans"] == [plan_line]
