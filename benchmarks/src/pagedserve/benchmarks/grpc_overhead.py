"""`pagedserve bench grpc-overhead`: the offline-throughput workload through `pagedserve serve` vs the offline engine.

Reproduce (run it ALONE on the machine; see benchmarks/README.md):

    pagedserve bench grpc-overhead          # = python -m pagedserve.benchmarks.grpc_overhead

Quick plumbing check (numbers meaningless):

    pagedserve bench grpc-overhead --num-prompts 4 --min-output 4 --max-output 8

Both phases run the same workload (`pagedserve.benchmarks.workloads`: 64 chat prompts of 20-300 tokens,
output lengths 16-256, greedy, ignore_eos), one after the other in this run:

1. Offline: `LLMEngine` in this process — `add_request` for every prompt, then `step()` until
   done; each token's time is taken when the step that produced it returns.
2. Served: `pagedserve serve` as a subprocess (control plane + data-plane child, the same
   engine flags), then 64 concurrent `Generate` streams from an asyncio client here; each
   token's time is when its chunk arrives at the client. The client, the control plane and
   the data plane share the machine's cores, as they would on a one-node deployment.

Reported: output tokens/s of each and the ratio (goal >= 0.9x), greedy agreement of the two
runs' tokens, and per-token latency: the inter-token gap (p50/p99) of each and the added
latency per token (served minus offline, at p50 and p99) — the cost the control plane, two
gRPC hops and the client's decoding add to every token — plus time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import itertools

from pagedserve.benchmarks.common import default_model, load_note, phase, warn_if_busy
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.workloads import chat_prompts, describe, output_lengths
from pagedserve.common.env import MODEL_HOME_HELP
from pagedserve.common.settings import parse_bytes

GOAL_RATIO = 0.9


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def gaps(times: dict[str, list[float]]) -> list[float]:
    return [b - a for ts in times.values() for a, b in itertools.pairwise(ts)]


def run_offline(args: argparse.Namespace, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    from pagedserve.dataplane import SamplingParams
    from pagedserve.dataplane.config import engine_config
    from pagedserve.dataplane.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        engine_config(
            model=args.model,
            model_home=args.model_home,
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
        )
    )
    warm = engine.add_request(prompts[0][:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.release(warm.request_id)
    engine.kv_cache.reset_prefix_cache()
    start = time.perf_counter()
    times: dict[str, list[float]] = {}
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), request_id=str(i))
        times[str(i)] = []
    tokens: dict[str, list[int]] = {k: [] for k in times}
    while engine.has_unfinished_requests():
        result = engine.step()
        now = time.perf_counter()
        for rid, taken in result.new_tokens.items():
            times[rid].extend([now] * len(taken))
            tokens[rid].extend(taken)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "times": times, "tokens": tokens, "start": start}


def _engine_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
    argv += [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--block-size",
        str(args.block_size),
    ]
    argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.model_home:
        argv += ["--model-home", args.model_home]
    return argv


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*cmd, *_engine_argv(args)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "gRPC on " in line:
            return proc, line.split("gRPC on ", 1)[1].split()[0]
    raise RuntimeError(f"pagedserve serve exited with {proc.wait()} before serving")


async def _serve_phase(address: str, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    from pagedserve.clients.python import AsyncGenerationClient, StreamChunk

    async with AsyncGenerationClient(address) as client:
        await client.generate(prompts[0][:16], max_tokens=4, temperature=0.0, ignore_eos=True)  # warm-up
        times: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
        tokens: dict[str, list[int]] = {k: [] for k in times}

        async def one(i: int) -> None:
            stream = client.generate_stream(
                prompts[i], max_tokens=lengths[i], temperature=0.0, ignore_eos=True, request_id=f"bench-{i}"
            )
            async for item in stream:
                if isinstance(item, StreamChunk) and item.token_ids:
                    now = time.perf_counter()
                    times[str(i)].extend([now] * len(item.token_ids))
                    tokens[str(i)].extend(item.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "times": times, "tokens": tokens, "start": start}


def summarize(name: str, run: dict[str, Any], total_tokens: int) -> dict[str, Any]:
    ttft = [ts[0] - run["start"] for ts in run["times"].values() if ts]
    itl = gaps(run["times"])
    return {
        "name": name,
        "wall_s": run["wall_s"],
        "tokens_per_s": total_tokens / run["wall_s"],
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--model-home", default=None, help=MODEL_HOME_HELP)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default="2GiB", help="engine KV pool size")


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    loads = load_note()
    warn_if_busy(loads)

    from transformers import AutoTokenizer

    from pagedserve.common.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model, args.model_home))
    prompts = chat_prompts(tokenizer, n=args.num_prompts)
    lengths = output_lengths(args.num_prompts, args.min_output, args.max_output)
    total = sum(lengths)
    print(describe(prompts, lengths), file=sys.stderr)

    offline = phase("offline engine", lambda: run_offline(args, prompts, lengths))
    proc, address = phase("start pagedserve serve", lambda: start_server(args))
    try:
        served = phase(
            f"served ({len(prompts)} concurrent gRPC streams)",
            lambda: asyncio.run(_serve_phase(address, prompts, lengths)),
        )
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)

    rows = [summarize("offline engine", offline, total), summarize("pagedserve serve (gRPC)", served, total)]
    same = sum(offline["tokens"][k] == served["tokens"][k] for k in offline["tokens"])
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    added_p50 = rows[1]["itl_p50_ms"] - rows[0]["itl_p50_ms"]
    added_p99 = rows[1]["itl_p99_ms"] - rows[0]["itl_p99_ms"]
    verdict = "meets" if ratio >= GOAL_RATIO else "MISSES"
    report.table(
        "offline engine vs the same workload through pagedserve serve",
        ["run", "output tok/s", "wall s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p99 ms"],
        [
            [
                r["name"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['wall_s']:.1f}",
                f"{r['itl_p50_ms']:.1f}",
                f"{r['itl_p99_ms']:.1f}",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
            ]
            for r in rows
        ],
        notes=[
            f"served / offline throughput: {ratio:.3f}x ({verdict} the >= {GOAL_RATIO}x goal)",
            f"added latency per token: p50 {added_p50:+.1f} ms, p99 {added_p99:+.1f} ms",
            f"greedy agreement: {same}/{len(prompts)} requests token-identical; load before: {loads}",
        ],
    )
    return {
        "rows": rows,
        "ratio": ratio,
        "added_latency_ms": {"p50": added_p50, "p99": added_p99},
        "identical_requests": same,
        "num_requests": len(prompts),
        "output_tokens": total,
    }


if __name__ == "__main__":
    from pagedserve.benchmarks.cli import main

    sys.exit(main(["grpc-overhead", *sys.argv[1:]]))
