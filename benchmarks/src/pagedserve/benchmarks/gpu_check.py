"""One check of pagedserve on a CUDA GPU, in under 8 minutes: kernels, exactness, bandwidth, throughput.

    benchmarks/src/pagedserve/benchmarks/gpu_check.sh [--wheels DIR] [--dry-run] [--out DIR] [--only STEP ...]

(the shell script installs missing pure-Python packages from wheels, then runs this module).
Steps, each in its own process under its own time limit, one after another:

1. kernels: tests/kernels/test_triton_kernels.py compiled on CUDA (PAGEDSERVE_KERNEL_TESTS=cuda:
   the interpreter fallback becomes an error), against the torch references.
2. exactness: the engine on CUDA (Triton attention, its memory planning profiled) against
   transformers' own generate on the same device and dtype, greedy, on a tiny random Llama, in
   fp32 and bf16: batched, then chunked prefill with preemption. A divergence passes only where
   the reference's top-2 logits tie within the dtype's tolerance (TIE_TOLERANCE); no block may leak.
3. attention: benchmarks/src/pagedserve/benchmarks/attention_kernels.py as is: decode attention, 32 sequences x 4k
   context, 16-bit and FP8 KV, GB/s against the device's datasheet HBM peak and its copy bandwidth.
4. throughput: a random-weight Llama-shaped model of ~1.2B parameters (Llama-3.2-1B's shape) in
   bf16, offline, `ignore_eos`: our engine vs transformers `generate` with static batches
   (benchmarks/src/pagedserve/benchmarks/peers.py's `run_transformers_static`, left padding), the same prompts and
   lengths, one after the other in one process.

It prints one table and writes `<out>/gpu_check.json` (every step's figures, the engine's
`gpu_memory_planned` log lines) next to each step's log. `--dry-run` runs nothing on a GPU:
it prints the plan and checks the imports, the steps' arguments and the model shapes.
Needs no network and no model weights.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.gpu_steps import (
    THROUGHPUT_SETTINGS,
    count_parameters,
    exactness_ok,
    llama_1b_config,
    run_exactness,
    run_throughput,
)

ROOT = Path(__file__).resolve().parents[4]  # the repository: benchmarks/src/pagedserve/benchmarks
if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    for dist in (
        "protos",
        "common",
        "clients/python",
        "kernels",
        "controlplane",
        "dataplane",
        "benchmarks",
        ".",
    ):
        sys.path.insert(0, str(ROOT / dist / "src"))

TIME_BUDGET_S = 480
STEPS = ("kernels", "exactness", "attention", "throughput")
# Pure-Python packages the steps import that a GPU image may lack, with what each needs in turn
# (their wheels go in the --wheels folder); torch, triton and transformers come with the image.
WHEELS_FOR_MODULE = {
    "structlog": ("structlog",),
    "pytest": ("pytest", "iniconfig", "pluggy", "packaging"),
    "hypothesis": ("hypothesis", "attrs", "sortedcontainers"),
    "tqdm": ("tqdm",),
}
REQUIRED_MODULES = ("torch", "triton", "transformers", "safetensors", "numpy", *WHEELS_FOR_MODULE)
# Our modules the steps import (the exactness step uses the engine tests' tiny model and prompts).
CHECKED_IMPORTS = (
    "pagedserve.dataplane",
    "pagedserve.kernels",
    "pagedserve.benchmarks.attention_kernels",
    "pagedserve.benchmarks.gpu_steps",
    "pagedserve.benchmarks.peers",
    "pagedserve.benchmarks.workloads",
    "pagedserve.benchmarks.tiny_models",
)


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    limit_s: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


# -- the plan -------------------------------------------------------------------------------------
def plan(args: argparse.Namespace, out: Path) -> list[Step]:
    py = sys.executable
    pytest_argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / 'kernels.xml'}"]
    if importlib.util.find_spec("xdist") is not None:
        pytest_argv += ["-n", "4"]  # Triton compiles kernels one at a time per process
    me = [py, "-m", "pagedserve.benchmarks.gpu_check"]
    throughput_args = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in THROUGHPUT_SETTINGS]
    steps = [
        Step(
            "kernels",
            "Triton kernel tests compiled on CUDA",
            170,
            (*pytest_argv, "tests/kernels/test_triton_kernels.py"),
            {"PAGEDSERVE_KERNEL_TESTS": "cuda"},
        ),
        Step(
            "exactness",
            "engine vs transformers greedy on CUDA, tiny Llama, fp32 and bf16",
            90,
            (*me, "--step", "exactness", "--step-json", str(out / "exactness.json")),
        ),
        Step(
            "attention",
            "decode attention GB/s, 32 seqs x 4k, 16-bit and FP8 KV",
            40,
            (
                *(py, "-m", "pagedserve.benchmarks.attention_kernels", "--device", "cuda"),
                *("--seqs", "32", "--context", "4096", "--json", str(out / "attention.json")),
            ),
        ),
        Step(
            "throughput",
            "offline tok/s, ~1.2B Llama bf16: engine vs transformers static batching",
            150,
            (*me, "--step", "throughput", "--step-json", str(out / "throughput.json"), *throughput_args),
        ),
    ]
    return [s for s in steps if s.name in args.only]


def missing_modules(names: Sequence[str]) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def wheels_needed(missing: Sequence[str]) -> list[str]:
    """The wheels (pip names) that would supply `missing` modules, where wheels can."""
    return [w for m in missing for w in WHEELS_FOR_MODULE.get(m, ())]


def dry_run(steps: Sequence[Step]) -> list[str]:
    """Print the plan; return the problems found (none: the real run can start)."""
    from pagedserve.benchmarks.report import format_table

    rows = [[s.name, s.what, f"{s.limit_s} s", " ".join(s.argv[1:])] for s in steps]
    print(format_table(["step", "what", "limit", "command (after python)"], rows))
    total = sum(s.limit_s for s in steps)
    print(f"\ntime limits add up to {total} s (budget {TIME_BUDGET_S} s)")
    problems: list[str] = []
    if total > TIME_BUDGET_S:
        problems.append(f"the steps' limits add up to {total} s, over the {TIME_BUDGET_S} s budget")
    missing = missing_modules(REQUIRED_MODULES)
    if missing:
        problems.append(f"not importable: {', '.join(missing)} (wheels: {', '.join(wheels_needed(missing))})")
    else:
        for name in CHECKED_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception as exc:
                problems.append(f"import {name}: {type(exc).__name__}: {exc}")
    for s in steps:
        problems += check_step_arguments(s)
    if "throughput" in {s.name for s in steps} and not missing:
        params = count_parameters(llama_1b_config())
        print(
            f"throughput model: Llama-shaped, {params / 1e9:.3f}B parameters, {2 * params / 2**30:.2f} GiB in bf16"
        )
        if not 1.0e9 <= params <= 1.5e9:
            problems.append(f"the throughput model has {params} parameters, not ~1B")
    return problems


def check_step_arguments(step: Step) -> list[str]:
    """Parse a step's arguments with the parser that will read them (nothing runs)."""
    argv = list(step.argv)
    try:
        if step.name == "attention":
            from pagedserve.benchmarks import attention_kernels

            attention_kernels.parse_args(argv[argv.index("pagedserve.benchmarks.attention_kernels") + 1 :])
        elif step.name in ("exactness", "throughput"):
            parse_args(argv[argv.index("pagedserve.benchmarks.gpu_check") + 1 :])
        else:
            tests = [a for a in argv if a.startswith("tests/")]
            absent = [t for t in tests if not (ROOT / t).exists()]
            if absent:
                return [f"{step.name}: no such test file {absent}"]
    except SystemExit:
        return [f"{step.name}: its arguments do not parse: {argv[1:]}"]
    return []


# -- the real run ---------------------------------------------------------------------------------
@dataclass
class StepResult:
    name: str
    status: str  # "PASS", "FAIL", "TIMEOUT"
    seconds: float
    summary: str
    data: dict[str, Any]


def run_step(step: Step, out: Path) -> tuple[str, float]:
    """Run one step with its output in `<out>/<name>.log`; (status, seconds)."""
    log = out / f"{step.name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {step.what} (limit {step.limit_s} s)", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        # Its own process group: an overrun kills the step's children too (pytest-xdist
        # workers), so nothing of it keeps the GPU busy during the next step.
        proc = subprocess.Popen(
            step.argv,
            cwd=ROOT,
            env={**os.environ, **step.env},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status = "PASS" if proc.wait(timeout=step.limit_s) == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "TIMEOUT"
    return status, time.perf_counter() - start


def memory_plans(log: Path) -> list[dict[str, Any]]:
    """The engine's `gpu_memory_planned` lines (JSON, since the log is no TTY) in a step's log."""
    plans = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if '"gpu_memory_planned"' in line:
            try:
                plans.append(json.loads(line[line.index("{") :]))
            except ValueError:
                continue
    return plans


def summarize(name: str, out: Path) -> tuple[str, dict[str, Any]]:
    """One line of a finished step's figures, and its data for the JSON."""
    if name == "kernels":
        xml = out / "kernels.xml"
        if not xml.exists():
            return "no test report", {}
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        line = f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
        return line, counts
    path = out / f"{name}.json"
    if not path.exists():
        return f"no {path.name}", {}
    data: dict[str, Any] = json.loads(path.read_text())
    return summary_line(name, data), data


def summary_line(name: str, data: dict[str, Any]) -> str:
    if name == "exactness":
        return "; ".join(
            f"{c['dtype']} {c['case']}: {c['exact']}/{c['prompts']} exact, {c['ties']} ties, "
            f"{len(c['mismatches'])} mismatches, {c['leaked_blocks']} leaked"
            for c in data["cases"]
        )
    if name == "attention":
        parts = []
        for r in data["rows"]:
            if "error" in r:
                parts.append(f"{r['case']}: {r['error']}")
                continue
            sheet = r["pct_datasheet"]
            parts.append(
                f"{r['case']}: {r['gbps']:.0f} GB/s"
                + (f" = {sheet:.1f}% of datasheet" if sheet is not None else "")
                + f" ({r['pct_copy_bw']:.1f}% of copy)"
            )
        speedup = data.get("fp8_speedup_vs_16bit")
        return "; ".join(parts) + (f"; FP8 {speedup:.2f}x faster than 16-bit" if speedup else "")
    if name == "throughput":
        eng, peer = data["engine"], data["transformers_static"]
        return (
            f"engine {eng['output_tok_s']:.0f} tok/s vs transformers static batch "
            f"{peer['batch_size']} {peer['output_tok_s']:.0f} tok/s: {data['speedup']:.2f}x"
        )
    return ""


def run_all(args: argparse.Namespace, steps: Sequence[Step], out: Path) -> int:
    import torch

    from pagedserve.benchmarks.report import Report

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --dry-run to check the plan here", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    report = Report(
        "gpu_check", out, ["benchmarks/src/pagedserve/benchmarks/gpu_check.sh", *sys.argv[1:]], progress=False
    )
    results: list[StepResult] = []
    for step in steps:
        status, seconds = run_step(step, out)
        summary, data = summarize(step.name, out)
        results.append(StepResult(step.name, status, seconds, summary, data))
    plans = [p for s in steps for p in memory_plans(out / f"{s.name}.log")]
    device = torch.cuda.get_device_name(0)
    report.table(
        f"GPU check on {device}",
        ["step", "status", "seconds", "result"],
        [[r.name, r.status, f"{r.seconds:.0f}", r.summary] for r in results],
        [f"logs: {out}/<step>.log; torch {torch.__version__}"]
        + [
            f"memory plan: {p.get('blocks')} blocks, KV {p.get('kv_bytes', 0) / 2**30:.2f} GiB, "
            f"activation peak {p.get('activation_peak', 0) / 2**20:.0f} MiB ({p.get('activation_source')}), "
            f"estimate {p.get('activation_estimate', 0) / 2**20:.0f} MiB"
            for p in plans
        ],
    )
    report.finish(
        {
            "device": device,
            "torch": torch.__version__,
            "steps": [vars(r) for r in results],
            "memory_plans": plans,
        }
    )
    return 0 if all(r.status == "PASS" for r in results) else 1


# -- entry point ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and check it; run nothing")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: a fresh one)")
    ap.add_argument("--only", nargs="+", default=list(STEPS), choices=STEPS, help="steps to run")
    ap.add_argument("--missing-packages", action="store_true", help="print the wheels missing modules need")
    ap.add_argument("--step", choices=("exactness", "throughput"), help=argparse.SUPPRESS)
    ap.add_argument("--step-json", type=Path, help=argparse.SUPPRESS)
    # A step on the CPU checks its code path, not the GPU: for this module's own tests.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--peer-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("num_prompts", "min_prompt", "min_output", "max_num_seqs", "peer_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        ap.error("need --min-prompt <= --max-prompt and --min-output <= --max-output")
    if args.step and args.step_json is None:
        ap.error("--step needs --step-json")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.missing_packages:
        print(" ".join(wheels_needed(missing_modules(REQUIRED_MODULES))))
        return 0
    if args.step:
        result = run_exactness(args.device) if args.step == "exactness" else run_throughput(args, args.device)
        args.step_json.parent.mkdir(parents=True, exist_ok=True)
        args.step_json.write_text(json.dumps(result, indent=1) + "\n")
        print(summary_line(args.step, result))
        return 0 if args.step != "exactness" or exactness_ok(result) else 1
    from pagedserve.benchmarks.report import default_out_dir

    out = (args.out or default_out_dir("gpu_check")).resolve()
    steps = plan(args, out)
    if args.dry_run:
        problems = dry_run(steps)
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print(f"\ndry run: {'OK' if not problems else f'{len(problems)} problems'}; nothing ran on a GPU")
        return 1 if problems else 0
    return run_all(args, steps, out)


if __name__ == "__main__":
    raise SystemExit(main())
