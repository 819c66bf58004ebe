"""`pagedserve bench serve`: online load against a running server, over gRPC or the OpenAI API.

    pagedserve serve &                                            # in another terminal
    pagedserve bench serve --address 127.0.0.1:50051 --request-rate 4 --num-prompts 64
    pagedserve bench serve --api openai --address http://127.0.0.1:8000 --concurrency 16
    pagedserve bench serve --peer vllm --concurrency 16 --num-prompts 64   # launches both servers

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once), or
with `--concurrency` C a closed loop keeps exactly C in flight. The run is bounded by
`--num-prompts` and `--max-duration` (requests not started by then are not sent; those in
flight are cancelled and counted as unfinished). Prompts are token ids (the chat workload
built with the model's tokenizer, or `--workload random` for models without one), greedy,
`ignore_eos`, one output length per request spread over [`--min-output`, `--max-output`].

Per request the client records when each token arrives: time to first token (TTFT), time per
output token after the first (TPOT), every inter-token gap (ITL) and end-to-end latency.
Reported: completed/failed requests, output tokens/s, requests/s, p50/p90/p99 of each
latency, and goodput: completed requests per second that met both `--ttft-slo` and
`--tpot-slo` (ms). The PNG shows the latency CDFs.

With `--launch` the benchmark starts `pagedserve serve` itself and stops it after the run;
`--peer vllm` also starts vLLM's `vllm serve` afterwards on the same workload and prints both
side by side (`benchmarks/src/pagedserve/benchmarks/serve_peers.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmarks.report import Report, fmt_pct
from pagedserve.benchmarks.serve_load import (
    GrpcTarget,
    OpenAITarget,
    Outcome,
    drive,
    plot_cdf,
    prompts_for,
    samples,
    summarize,
)
from pagedserve.benchmarks.serve_peers import (
    DEFAULT_CONCURRENCY,
    add_launch_arguments,
    launching,
    run_launched,
    validate,
)
from pagedserve.benchmarks.workloads import output_lengths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api",
        choices=["grpc", "openai"],
        default=None,
        help="the API to drive (default: grpc; openai with --launch/--peer)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="gRPC HOST:PORT or http://HOST:PORT (openai); not with --launch/--peer "
        "(default: 127.0.0.1:50051 for grpc, http://127.0.0.1:8000 for openai)",
    )
    p.add_argument("--model", default=None, help="model name to send (openai) (default: the server's first)")
    p.add_argument("--api-key", default=None, help="API key to send (default: none)")
    p.add_argument("--workload", choices=["chat", "random"], default="chat")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or store name for the chat workload (default: --serve-model)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the random workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop with this many requests in flight "
        f"(default: open loop at --request-rate; {DEFAULT_CONCURRENCY} with --launch/--peer at an infinite rate)",
    )
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds; later requests are not sent")
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="goodput target for TTFT, ms")
    p.add_argument("--tpot-slo", type=float, default=200.0, help="goodput target for TPOT, ms")
    p.add_argument("--seed", type=int, default=0)
    add_launch_arguments(p)


def make_target(args: argparse.Namespace) -> Any:
    if args.api == "grpc":
        return GrpcTarget(args.address or "127.0.0.1:50051", args.api_key)
    return OpenAITarget(args.address or "http://127.0.0.1:8000", args.model, args.api_key)


def run(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    validate(args)
    if launching(args):
        return run_launched(args, report)
    prompts = prompts_for(args, args.num_prompts, args.seed)
    lengths = output_lengths(len(prompts), args.min_output, args.max_output, seed=args.seed)

    async def session() -> tuple[list[Outcome], float]:
        # Built inside the loop: the gRPC client's channel belongs to the loop that made it.
        return await drive(args, make_target(args), prompts, lengths, report)

    outcomes, wall = asyncio.run(session())
    s = summarize(outcomes, wall, args.ttft_slo, args.tpot_slo)
    mode = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.request_rate:g}/s"
    report.table(
        f"serve ({args.api}, {mode})",
        [
            "requests",
            "failed",
            "duration s",
            "output tok/s",
            "req/s",
            f"goodput req/s (TTFT<={args.ttft_slo:g}ms, TPOT<={args.tpot_slo:g}ms)",
        ],
        [
            [
                f"{s['completed']}/{s['requests']}",
                str(s["failed"]),
                f"{wall:.1f}",
                f"{s['output_tokens_per_s']:.1f}",
                f"{s['requests_per_s']:.2f}",
                f"{s['goodput_requests_per_s']:.2f} ({fmt_pct(s['goodput_fraction'])})",
            ]
        ],
        notes=s["errors"],
    )
    stats = s["latency_ms"]
    rows = [
        [name, *(f"{stats[name][f'p{p}']:.1f}" for p in (50, 90, 99)), f"{stats[name]['mean']:.1f}"]
        for name in ("TTFT", "TPOT", "ITL", "E2E")
    ]
    report.table("latency, ms", ["metric", "p50", "p90", "p99", "mean"], rows)
    fig = report.figure(ncols=2, width=10)
    if fig is not None:
        values = samples(outcomes)
        for ax, name in zip(fig.axes, ("TTFT", "ITL"), strict=True):
            plot_cdf(ax, values[name], name, None)
        report.save_figure(fig)
    return {
        "api": args.api,
        "mode": mode,
        **{k: s[k] for k in ("completed", "failed", "wall_s", "output_tokens_per_s", "requests_per_s")},
        "goodput_requests_per_s": s["goodput_requests_per_s"],
        "latency_ms": stats,
    }


if __name__ == "__main__":
    from pagedserve.benchmarks.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
