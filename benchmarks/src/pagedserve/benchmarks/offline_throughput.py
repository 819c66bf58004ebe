"""Kept for old commands: `python -m pagedserve.benchmarks.offline_throughput` = `pagedserve bench throughput`.

With `--tensor-parallel-size N` it measures tensor parallelism instead: one chat workload on
our engine with N ranks (`--threads`/N torch threads each) and, in the same run, its peers with
one rank, one run after the other: one rank with all `--threads` (the same threads in all), and
one rank with a rank's share of them (the fair peer when other processes contend for the 2
cores: multi-threaded matmuls then stall on each other). Reported per run: useful output tok/s
and, for N ranks, the communication share of step time (rank 0's seconds in its all-reduces and
plan broadcasts over the summed step times; an all-reduce also waits for the slower rank, so the
share includes that imbalance).

    python -m pagedserve.benchmarks.offline_throughput --tensor-parallel-size 3            # SmolLM2: 9/3 heads
    python -m pagedserve.benchmarks.offline_throughput --tensor-parallel-size 2 --model DIR  # heads divisible by 2

On an idle 2-core CPU expect no speed-up: the ranks split the same two cores and add a
collective per row-parallel layer (2 per decoder layer) to every step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.common import default_model, load_note, warn_if_busy
from pagedserve.benchmarks.throughput import main
from pagedserve.common.settings import parse_bytes


@dataclass(frozen=True)
class TensorParallelRun:
    tensor_parallel_size: int
    threads_per_rank: int
    output_tokens: int
    step_seconds: float
    comm_seconds: float
    steps: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.step_seconds

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.step_seconds


def parse_tensor_parallel_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m pagedserve.benchmarks.offline_throughput --tensor-parallel-size N"
    )
    ap.add_argument("--tensor-parallel-size", type=int, required=True, help="ranks of the measured run")
    ap.add_argument("--model", default=default_model(), help="store name or local HF folder")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all (split among the ranks)")
    ap.add_argument(
        "--kv-cache-memory", type=parse_bytes, default="256MiB", help="each rank's KV pool (ample here)"
    )
    ap.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(list(argv))
    if args.tensor_parallel_size < 2:
        ap.error("--tensor-parallel-size must be >= 2 (the run with 1 is the peer)")
    return args


def run_tensor_parallel(
    args: argparse.Namespace,
    model: str,
    tp: int,
    per_rank: int,
    prompts: list[list[int]],
    lengths: list[int],
) -> tuple[TensorParallelRun, list[list[int]]]:
    """Warm up, then drive the engine step by step on the workload; comm seconds from rank 0."""
    from pagedserve.dataplane import LLM, SamplingParams

    llm = LLM(
        model,
        tensor_parallel_size=tp,
        num_threads=per_rank,
        dtype="float32",
        kv_cache_memory=args.kv_cache_memory,
    )
    engine = llm.engine
    try:
        llm.generate(
            prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        llm.reset_prefix_cache()
        group = engine.parallel.group if engine.parallel is not None else None
        comm_before = group.comm_seconds if group is not None else 0.0
        requests = [
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(prompts, lengths, strict=True)
        ]
        step_s, steps = 0.0, 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            step_s += time.perf_counter() - start
            steps += 1
        comm_s = (group.comm_seconds if group is not None else 0.0) - comm_before
        outputs = [list(r.output_token_ids) for r in requests]
    finally:
        if engine.parallel is not None:
            engine.parallel.shutdown()
    run = TensorParallelRun(tp, per_rank, sum(len(o) for o in outputs), step_s, comm_s, steps)
    return run, outputs


def tensor_parallel_main(argv: Sequence[str]) -> int:
    from transformers import AutoTokenizer

    from pagedserve.benchmarks.workloads import chat_prompts, describe, output_lengths
    from pagedserve.common.models import resolve_model_path

    args = parse_tensor_parallel_args(argv)
    loads = load_note()
    warn_if_busy(loads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    prompts = chat_prompts(tokenizer, args.num_prompts, args.min_prompt, args.max_prompt, args.seed)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output, args.seed)
    print(f"workload: {describe(prompts, lengths)}", file=sys.stderr)
    # The peers first (one rank with all the threads; one rank with a rank's share of them,
    # the fair peer when other processes contend for the cores), then the split run; never
    # side by side.
    tp, per_rank = args.tensor_parallel_size, max(1, args.threads // args.tensor_parallel_size)
    plan = [(1, args.threads), *([(1, per_rank)] if per_rank != args.threads else []), (tp, per_rank)]
    runs, outputs = [], []
    for ranks, threads in plan:
        run, out = run_tensor_parallel(args, str(path), ranks, threads, prompts, lengths)
        runs.append(run)
        outputs.append(out)
    split = runs[-1]
    same = sum(a == b for a, b in zip(outputs[0], outputs[-1], strict=True))
    print(f"{'ranks':>5} {'threads/rank':>12} {'tok/s':>8} {'step s':>8} {'comm s':>8} {'comm share':>10}")
    for run in runs:
        print(
            f"{run.tensor_parallel_size:>5} {run.threads_per_rank:>12} {run.tok_s:>8.1f} "
            f"{run.step_seconds:>8.2f} {run.comm_seconds:>8.2f} {run.comm_share:>10.1%}"
        )
    for peer in runs[:-1]:
        print(f"tp={tp} / tp=1 ({peer.threads_per_rank} threads) throughput: {split.tok_s / peer.tok_s:.2f}x")
    print(f"same greedy tokens as tp=1: {same}/{len(prompts)} requests; load average at start {loads}")
    if args.json_out:
        figures = {
            "model": str(path),
            "workload": describe(prompts, lengths),
            "runs": [asdict(r) | {"tok_s": r.tok_s, "comm_share": r.comm_share} for r in runs],
            "ratios": [split.tok_s / peer.tok_s for peer in runs[:-1]],
            "same_greedy_requests": same,
            "load_average_at_start": loads,
        }
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if any(a.startswith("--tensor-parallel-size") for a in argv):
        sys.exit(tensor_parallel_main(argv))
    sys.exit(main())
