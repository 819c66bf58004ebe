"""`bench throughput`, the report: the goals, the JSON report of one round, its tables and
plot, and the summary of repeated rounds."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.peers import PeerRun, agreement
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.roofline import LinearShapes, Roofline
from pagedserve.benchmarks.throughput_engine import EngineRun, phase_stats
from pagedserve.benchmarks.workloads import describe

GOAL_RATIO = 2.0
GOAL_ROOFLINE = 0.70


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

    from pagedserve.kernels.cpu_isa import cpu_report

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
