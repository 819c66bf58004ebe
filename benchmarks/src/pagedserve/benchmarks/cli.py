"""`pagedserve bench ...`: every benchmark behind one command.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args, report) -> dict`: it prints its tables through the `Report`, draws its plot and
returns what goes into `<out>/<name>.json` (`--out`; by default a fresh
`./pagedserve-bench-results/<name>-<timestamp>/`, never the committed `benchmarks/results/`).
Modules are imported only when their subcommand runs, so `pagedserve --help` stays fast and
`memory` / `plan` never import torch. A new subcommand (the online `serve` benchmark) is one
more entry in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.isa_cap import CAPS, reexec_capped
from pagedserve.benchmarks.report import RESULTS_ROOT, Report, default_out_dir
from pagedserve.common.settings import ArgumentParser

# name -> (module, one-line help). Help text must not need the module imported.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "throughput": (
        "pagedserve.benchmarks.throughput",
        "offline tokens/s: our engine on a small workload (quick, the default); --full adds transformers "
        "(static batching and generate_batch) on the 64-prompt one, --peers vllm vLLM",
    ),
    "memory": (
        "pagedserve.benchmarks.memory",
        "KV utilization and fragmentation: contiguous pre-allocation vs our paged pool, on real lengths",
    ),
    "plan": (
        "pagedserve.benchmarks.plan",
        "the KV memory budget (GPU x utilization - weights - activations) for a model and a GPU",
    ),
    "prefix-caching": (
        "pagedserve.benchmarks.prefix_caching",
        "multi-turn customer-service chats with prefix caching on vs off (TTFT, throughput)",
    ),
    "pressure": (
        "pagedserve.benchmarks.pressure",
        "a saturated replay on a small KV pool: preemption by recompute vs swap vs auto (recomputed tokens, TTFT)",
    ),
    "trace": (
        "pagedserve.benchmarks.traces",
        "record a workload's real prompt/output lengths (for `memory`)",
    ),
    "serve": (
        "pagedserve.benchmarks.serve",
        "online load on a running server (gRPC or OpenAI HTTP), or --launch / --peer vllm to start "
        "pagedserve serve (then vLLM's server) itself: throughput, TTFT/TPOT/ITL percentiles, goodput",
    ),
    "grpc-overhead": (
        "pagedserve.benchmarks.grpc_overhead",
        "the offline workload through `pagedserve serve` vs the offline engine: tok/s ratio, added latency",
    ),
    "priority": (
        "pagedserve.benchmarks.priority",
        "a priority-0 request on a KV pool full of priority-10 streams: its TTFT vs 2 decode steps + its prefill",
    ),
    "tenants": (
        "pagedserve.benchmarks.tenants",
        "per-tenant fairness: tenant a floods, tenant b's TTFT vs a's throughput (a alone, a floods + b, a = b)",
    ),
    "guard": (
        "pagedserve.benchmarks.guard",
        "a guard stream's longest inter-token gap over its median while hostile or heavy input runs (target 3x)",
    ),
    "step-profile": (
        "pagedserve.benchmarks.step_profile",
        "one decode and one prefill step profiled by op class, fused vs transformers' layers, plus an A/B",
    ),
}


# Kernel benchmarks with their own argument parsers: `pagedserve bench NAME ARGS...` runs
# `module.main(ARGS)` (they print their tables and write JSON with --json).
SCRIPTS: dict[str, tuple[str, str]] = {
    "fp8-quality": (
        "pagedserve.benchmarks.fp8_quality",
        "KV cache quality (bf16, FP8): KV bytes, blocks, perplexity and greedy agreement per kv_cache_dtype",
    ),
    "structured": (
        "pagedserve.benchmarks.structured",
        "structured outputs: constrained vs unconstrained tok/s on the same prompts, compile p50/p99, mask share",
    ),
    "quantized": (
        "pagedserve.benchmarks.quantized",
        "GGUF served quantized: tok/s single-stream and batched vs our fp32 engine and llama.cpp, agreement, weight bytes",
    ),
    "gguf-quality": (
        "pagedserve.benchmarks.gguf_quality",
        "GGUF weights served quantized (Q8_0, Q4_K, Q4_0, the default Q4_1 file): perplexity vs the fp32 model",
    ),
    "speculative": (
        "pagedserve.benchmarks.speculative",
        "speculative decoding: code editing, document QA, JSON echo and chat, with and without n-gram / suffix drafting",
    ),
    "quality": (
        "pagedserve.benchmarks.quality",
        "fp32 vs bf16 weights vs --quantization int8: perplexity, greedy agreement and top-2 logit margins, "
        "real and random weights",
    ),
    "attention-kernels": (
        "pagedserve.benchmarks.attention_kernels",
        "decode attention GB/s: Triton 16-bit vs FP8 on CUDA (vs the HBM peak); C++/torch on the CPU",
    ),
}


def add_bench_parser(subparsers: Any) -> None:
    """Register `bench` and its subcommands on the top-level CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, memory, plan, ...")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in SCRIPTS.items():
        p = sub.add_parser(
            name, help=help_text, description=f"{help_text} (arguments: {name} --help)", add_help=False
        )
        p.add_argument("script_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
        p.set_defaults(func=run_script, bench_module=module)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--out",
            type=Path,
            default=None,
            help=f"directory for {name}.json and {name}.png (default: a fresh "
            f"./{RESULTS_ROOT}/{name}-<timestamp>; the committed figures are refreshed only "
            "with --out benchmarks/results)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument(
            "--cap-isa",
            choices=CAPS,
            default=None,
            help="limit every engine of the run (ours, oneDNN, torch, vLLM) to this ISA: an AVX-512 "
            "machine then measures what an AVX2-only one would (benchmarks/src/pagedserve/benchmarks/isa_cap.py says what it caps) "
            "(default: no cap, every engine at the best ISA the CPU runs)",
        )
        p.set_defaults(func=run_bench, bench_module=module, bench_name=name)
        _lazy_arguments(p, module)


def _lazy_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    # Arguments are needed to parse, so the module is imported here; each keeps torch out of
    # module scope, so this stays cheap.
    importlib.import_module(module).add_arguments(parser)


def run_script(args: argparse.Namespace) -> int:
    return run_script_module(args.bench_module, list(args.script_args))


def run_script_module(module_name: str, argv: list[str]) -> int:
    """Run a kernel benchmark's own `main(argv)` (the top-level CLI routes here directly,
    because argparse cannot hand options like `--help` through to a sub-parser)."""
    code: int | None = importlib.import_module(module_name).main(argv)
    return code or 0


def run_bench(args: argparse.Namespace) -> int:
    if args.cap_isa:
        reexec_capped(args.cap_isa)
    module = importlib.import_module(args.bench_module)
    command = ["pagedserve", "bench", *sys.argv[sys.argv.index("bench") + 1 :]] if "bench" in sys.argv else []
    out = args.out if args.out is not None else default_out_dir(args.bench_name)
    report = Report(args.bench_name, out, command, progress=not args.no_progress)
    results: dict[str, Any] = module.run(args, report)
    report.finish(results)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.benchmarks.cli memory ...` = `pagedserve bench memory ...`."""
    parser = ArgumentParser(prog="pagedserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
