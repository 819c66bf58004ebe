"""Memory pressure: one saturated replay under preemption by recompute, swap and auto, one run.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench pressure                         # = python -m pagedserve.benchmarks.pressure

Quick plumbing check (numbers meaningless):

    pagedserve bench pressure --requests 6 --max-tokens 8 --kv-cache-memory 2MiB

What it does, in one process and strictly one mode after another:

1. Workload: the first `--requests` requests of a length trace (`--trace`, default the
   shipped `chat` trace, benchmarks/src/pagedserve/benchmarks/traces.py): each request's prompt length is the trace's,
   its output length the trace's capped at `--max-tokens`. Prompt token ids are drawn at
   random from the model's vocabulary (seeded, the same for every mode): KV demand depends on
   lengths, not on which tokens. Every request is submitted at once (a saturated replay) with
   greedy sampling and `ignore_eos`, so every mode does the same work.
2. For each of `--modes` (default recompute, swap, auto): a fresh fp32 `LLM` whose device KV
   pool is `--kv-cache-memory` (default 48MiB: a fraction of the workload's KV demand, so the
   scheduler must preempt) with `preemption_mode=<mode>` and `--swap-space` GiB of host pool
   (default: the engine's own, the device pool's bytes on the CPU; no host pool for
   recompute). Warm-up: 2 short requests, then the prefix cache is reset and the engine's
   stats are snapshotted. THE measured run drives `llm.engine.step()` until all is done.
3. Per mode: tokens recomputed = tokens the engine computed (sum of `StepResult.
   num_batched_tokens`) minus what the workload needs without preemption (each request's
   prompt less its prefix-cache hit at first admission, plus output - 1 decode tokens), also
   as a share of all computed tokens; preemptions by mode, blocks swapped out/in and swap
   seconds (EngineStats deltas); output tok/s over the wall time; TTFT p50/p99 (first token -
   submission); greedy agreement with the first mode's outputs.
4. Goal lines: auto re-does < 5% of the tokens, and auto's throughput beats recompute-only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.common import default_model, load_note, phase, warn_if_busy
from pagedserve.benchmarks.prefix_caching_run import percentile
from pagedserve.benchmarks.report import Report, fmt_pct
from pagedserve.benchmarks.traces import load_trace
from pagedserve.common.settings import parse_bytes

MODES = ("recompute", "swap", "auto")
GOAL_RECOMPUTED_SHARE = 0.05  # auto re-does fewer than 5% of the tokens


def build_workload(
    trace: str, num_requests: int, max_tokens: int, vocab_size: int, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request: the trace's lengths, random ids."""
    t = load_trace(trace)
    n = min(num_requests, t.num_requests)
    rng = random.Random(seed)
    hi = max(2, vocab_size) - 1
    return [
        ([rng.randint(1, hi) for _ in range(t.prompt_tokens[i])], max(1, min(max_tokens, t.output_tokens[i])))
        for i in range(n)
    ]


def run_mode(
    args: argparse.Namespace, model: str, mode: str, workload: list[tuple[list[int], int]]
) -> dict[str, Any]:
    """One measured run of the workload with `preemption_mode=mode`."""
    from pagedserve.dataplane import LLM, SamplingParams

    settings: dict[str, Any] = {
        "dtype": "float32",
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": args.kv_cache_memory,
        "enable_prefix_caching": not args.no_prefix_caching,
        "num_threads": args.threads,
        "preemption_mode": mode,
    }
    if args.swap_space is not None and mode != "recompute":
        settings["swap_space"] = args.swap_space
    t = time.perf_counter()
    llm = LLM(model, **settings)
    load_s = time.perf_counter() - t
    engine = llm.engine
    warm = llm.generate(
        [[3, 5, 7, 11] * 4, [13, 17] * 8],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(len(o.token_ids) == 4 for o in warm)
    llm.reset_prefix_cache()
    before = engine.stats()

    requests = []
    t0 = time.monotonic()
    for i, (prompt, out_len) in enumerate(workload):
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        requests.append(engine.add_request(prompt, params, request_id=f"p{i}"))
    first_cached: dict[str, int] = {}
    batched = steps = preempted = 0
    peak_swapped = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        batched += result.num_batched_tokens
        preempted += result.num_preempted
        for r in requests:  # prefix-cache hit at first admission (a re-admission overwrites it)
            if r.request_id not in first_cached and r.num_computed_tokens > 0 and r.num_preemptions == 0:
                first_cached[r.request_id] = r.num_cached_tokens
        peak_swapped = max(peak_swapped, engine.stats().num_swapped)
        for r in result.finished:
            engine.release(r.request_id)
    wall = time.monotonic() - t0
    after = engine.stats()
    engine.check_integrity()

    outputs = [list(r.output_token_ids) for r in requests]
    out_tokens = sum(len(o) for o in outputs)
    needed = sum(
        len(r.prompt_token_ids) - first_cached.get(r.request_id, 0) + len(o) - 1
        for r, o in zip(requests, outputs, strict=True)
    )
    recomputed = batched - needed
    ttfts = [r.first_token_time - r.arrival_time for r in requests if r.first_token_time is not None]
    row = {
        "mode": mode,
        "load_seconds": load_s,
        "wall_seconds": wall,
        "steps": steps,
        "num_blocks": after.total_blocks,
        "host_blocks": after.host_total_blocks,
        "output_tokens": out_tokens,
        "computed_tokens": batched,
        "needed_tokens": needed,
        "recomputed_tokens": recomputed,
        "recomputed_share": recomputed / batched if batched else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "preemptions_swap": after.num_preemptions_swap - before.num_preemptions_swap,
        "preemptions_recompute": after.num_preemptions_recompute - before.num_preemptions_recompute,
        "blocks_swapped_out": after.blocks_swapped_out - before.blocks_swapped_out,
        "blocks_swapped_in": after.blocks_swapped_in - before.blocks_swapped_in,
        "swap_seconds": after.swap_seconds - before.swap_seconds,
        "peak_swapped_requests": peak_swapped,
        "output_tok_s": out_tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "outputs": outputs,
    }
    del llm, engine, requests
    gc.collect()
    return row


def build_report(
    runs: list[dict[str, Any]], workload: list[tuple[list[int], int]], kv_demand_tokens: int
) -> dict[str, Any]:
    by_mode = {r["mode"]: r for r in runs}
    reference = runs[0]["outputs"]
    modes: dict[str, Any] = {}
    for r in runs:
        summary = {k: v for k, v in r.items() if k != "outputs"}
        summary["same_greedy_tokens_as_" + runs[0]["mode"]] = sum(
            a == b for a, b in zip(r["outputs"], reference, strict=True)
        )
        modes[r["mode"]] = summary
    ratio = None
    if "auto" in by_mode and "recompute" in by_mode and by_mode["recompute"]["output_tok_s"]:
        ratio = by_mode["auto"]["output_tok_s"] / by_mode["recompute"]["output_tok_s"]
    goals: dict[str, Any] = {}
    if "auto" in by_mode:
        goals["auto_recomputed_share_below_5pct"] = (
            by_mode["auto"]["recomputed_share"] < GOAL_RECOMPUTED_SHARE
        )
    if ratio is not None:
        goals["auto_beats_recompute_throughput"] = ratio > 1.0
    return {
        "workload": {
            "requests": len(workload),
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": sum(o for _, o in workload),
            "kv_demand_tokens": kv_demand_tokens,
        },
        "modes": modes,
        "auto_over_recompute_throughput": ratio,
        "goals": goals,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=default_model(), help="model name or path (default: %(default)s)")
    ap.add_argument(
        "--trace", default="chat", help="a shipped trace name or a trace file (default: %(default)s)"
    )
    ap.add_argument("--requests", type=int, default=32, help="first N requests of the trace")
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on each request's output tokens")
    ap.add_argument("--modes", default=",".join(MODES), help="preemption modes to run, in order")
    ap.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default="48MiB",
        help="device KV pool bytes, e.g. 48MiB (small: forces preemption)",
    )
    ap.add_argument("--swap-space", type=float, default=None, help="host pool GiB (default: the engine's)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="run with prefix caching off")
    ap.add_argument("--seed", type=int, default=0, help="prompt token seed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: choose from {','.join(MODES)}, got {args.modes!r}")
    loads = load_note()
    warn_if_busy(loads)
    from transformers import AutoConfig

    from pagedserve.common.models import resolve_model_path

    model = str(resolve_model_path(args.model))
    vocab = int(getattr(AutoConfig.from_pretrained(model, local_files_only=True), "vocab_size", 32000))
    workload = build_workload(args.trace, args.requests, args.max_tokens, vocab, args.seed)
    demand = sum(len(p) + o for p, o in workload)
    runs = [phase(f"mode {m}", functools.partial(run_mode, args, model, m, workload)) for m in modes]
    rep = build_report(runs, workload, demand)
    rep["config"] = {
        "model": args.model,
        "trace": args.trace,
        "kv_cache_memory": args.kv_cache_memory,
        "swap_space": args.swap_space,
        "prefix_caching": not args.no_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "threads": args.threads,
        "loadavg_start": loads,
    }
    first = rep["modes"][modes[0]]
    pool_tokens = first["num_blocks"] * args.block_size
    rows = [
        [
            m,
            f"{r['recomputed_tokens']} ({fmt_pct(r['recomputed_share'])})",
            f"{r['preemptions_swap']}/{r['preemptions_recompute']}",
            f"{r['blocks_swapped_out']}/{r['blocks_swapped_in']}",
            f"{r['output_tok_s']:.1f}",
            f"{1000 * r['ttft_p50_s']:.0f}",
            f"{1000 * r['ttft_p99_s']:.0f}",
            f"{r[f'same_greedy_tokens_as_{modes[0]}']}/{len(workload)}",
        ]
        for m, r in rep["modes"].items()
    ]
    ratio = rep["auto_over_recompute_throughput"]
    notes = [
        f"{len(workload)} requests, KV demand {demand} tokens vs a device pool of {pool_tokens} tokens "
        f"({demand / max(pool_tokens, 1):.1f}x); host (swap) pool "
        f"{max(r['host_blocks'] for r in rep['modes'].values())} blocks (none for recompute)",
    ]
    if ratio is not None:
        notes.append(f"auto / recompute-only throughput: {ratio:.2f}x")
    for goal, ok in rep["goals"].items():
        notes.append(f"goal {goal}: {'met' if ok else 'NOT met'}")
    report.table(
        "Preemption modes under memory pressure",
        [
            "mode",
            "tokens recomputed",
            "preempt swap/recompute",
            "blocks out/in",
            "output tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "same greedy",
        ],
        rows,
        notes,
    )
    fig = report.figure()
    if fig is not None:
        ax = fig.axes[0]
        names = list(rep["modes"])
        ax.bar(names, [rep["modes"][m]["output_tok_s"] for m in names])
        ax.set_ylabel("output tok/s")
        report.save_figure(fig)
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["pressure", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
