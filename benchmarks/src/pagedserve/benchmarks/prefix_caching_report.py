"""`bench prefix-caching`, the report: each run summarized, the cached and uncached runs side by
side against the claimed gains, printed and plotted."""

from __future__ import annotations

import argparse
import bisect
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.dialogues import Dialogue
from pagedserve.benchmarks.prefix_caching_run import DialogueRun, common_prefix, percentile
from pagedserve.benchmarks.report import Report

# A common claim for prefix caching with a shared system prompt: TTFT -60% and >= 3x throughput
# with caching on (SGLang's RadixAttention paper, Zheng et al., arXiv:2312.07104, measures gains of
# this order from reusing shared prefixes).
CLAIMED_TTFT_REDUCTION = 0.60


CLAIMED_THROUGHPUT_RATIO = 3.0


# -- report ------------------------------------------------------------------------------------
def summarize(run: DialogueRun) -> dict[str, Any]:
    turns = run.turns
    ttft = [r.ttft_s for r in turns]
    later = [r.ttft_s for r in turns if r.turn >= 2]  # past each conversation's cold first turn
    out_tokens = sum(len(r.output_token_ids) for r in turns)
    prompt = sum(r.prompt_tokens for r in turns)
    cached = sum(r.cached_tokens for r in turns)
    st = run.prefix_stats
    by_turn: dict[int, dict[str, Any]] = {}
    for k in sorted({r.turn for r in turns}):
        rs = [r for r in turns if r.turn == k]
        by_turn[k] = {
            "turns": len(rs),
            "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
            "mean_cached_tokens": statistics.fmean(r.cached_tokens for r in rs),
            "ttft_p50_s": percentile([r.ttft_s for r in rs], 50),
            "ttft_p90_s": percentile([r.ttft_s for r in rs], 90),
        }
    return {
        "enable_prefix_caching": run.enable_prefix_caching,
        "load_seconds": run.load_seconds,
        "warmup_seconds": run.warmup_seconds,
        "wall_seconds": run.wall_seconds,
        "client_seconds": run.client_seconds,
        "turns": len(turns),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / run.wall_seconds,
        "turns_per_s": len(turns) / run.wall_seconds,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_turn2plus_s": percentile(later, 50),
        "ttft_p90_turn2plus_s": percentile(later, 90),
        "latency_p50_s": percentile([r.latency_s for r in turns], 50),
        "prompt_tokens": prompt,
        "mean_prompt_tokens": prompt / len(turns),
        "cached_tokens": cached,
        "reusable_tokens": sum(r.reusable_tokens for r in turns),
        "prompt_tokens_computed": prompt - cached,
        "hit_rate": st["hits"] / st["queries"] if st.get("queries") else 0.0,
        "reusable_rate": sum(r.reusable_tokens for r in turns) / prompt,
        "prefix_cache_stats": st,
        "steps": run.steps,
        "mean_step_ms": 1e3 * statistics.fmean(s[1] for s in run.step_log) if run.step_log else 0.0,
        "mean_steps_to_first_token": _mean_steps_to_first_token(run),
        "batched_tokens": run.batched_tokens,
        "preempted": run.preempted,
        "num_blocks": run.num_blocks,
        "mean_reply_tokens_before_eos": statistics.fmean(r.reply_tokens for r in turns),
        "by_turn": by_turn,
    }


def _mean_steps_to_first_token(run: DialogueRun) -> float:
    """Mean number of steps that started at or after each turn's arrival up to its first token."""
    starts = [s[0] for s in run.step_log]
    if not starts or not run.turns:
        return 0.0
    counts = [
        bisect.bisect_right(starts, r.arrival_s + r.ttft_s) - bisect.bisect_left(starts, r.arrival_s)
        for r in run.turns
    ]
    return statistics.fmean(counts)


def agreement(a: DialogueRun, b: DialogueRun) -> dict[str, Any]:
    bs = {r.request_id: r for r in b.turns}
    same_prompt = same_output = matched = total = 0
    diverged: list[tuple[str, int]] = []
    missing = 0
    for r in a.turns:
        o = bs.get(r.request_id)
        if o is None:
            missing += 1
            continue
        same_prompt += r.prompt_token_ids == o.prompt_token_ids
        n = common_prefix(r.output_token_ids, o.output_token_ids)
        matched += n
        total += len(r.output_token_ids)
        if r.output_token_ids == o.output_token_ids:
            same_output += 1
        else:
            diverged.append((r.request_id, n))
    return {
        "turns": len(a.turns),
        "missing": missing,
        "identical_prompts": same_prompt,
        "identical_outputs": same_output,
        "tokens_before_first_divergence": matched,
        "tokens": total,
        "diverged": sorted(diverged),
    }


def build_report(
    args: argparse.Namespace,
    model_path: Path,
    dialogues: list[Dialogue],
    system_tokens: int,
    runs: dict[str, DialogueRun],
    loads: dict[str, tuple[float, ...]],
) -> dict[str, Any]:
    import torch

    rep: dict[str, Any] = {
        "loadavg": loads,
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()},
        "model": str(model_path),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
        "workload": {
            "name": "customer_service_dialogues",
            "conversations": len(dialogues),
            "turns": sum(d.num_turns for d in dialogues),
            "turns_per_conversation": [d.num_turns for d in dialogues],
            "topics": [d.topic for d in dialogues],
            "system_prompt_tokens": system_tokens,
        },
        "runs": {k: summarize(v) for k, v in runs.items()},
    }
    goals: dict[str, Any] = {
        "claimed_ttft_reduction": CLAIMED_TTFT_REDUCTION,
        "claimed_throughput_ratio": CLAIMED_THROUGHPUT_RATIO,
    }
    if "on" in runs and "off" in runs:
        on, off = rep["runs"]["on"], rep["runs"]["off"]
        cmp = {
            "ttft_p50_reduction": 1 - on["ttft_p50_s"] / off["ttft_p50_s"],
            "ttft_p90_reduction": 1 - on["ttft_p90_s"] / off["ttft_p90_s"],
            "ttft_mean_reduction": 1 - on["ttft_mean_s"] / off["ttft_mean_s"],
            "ttft_p50_turn2plus_reduction": 1 - on["ttft_p50_turn2plus_s"] / off["ttft_p50_turn2plus_s"],
            "ttft_p90_turn2plus_reduction": 1 - on["ttft_p90_turn2plus_s"] / off["ttft_p90_turn2plus_s"],
            "output_throughput_ratio": on["output_tok_s"] / off["output_tok_s"],
            "turns_per_s_ratio": on["turns_per_s"] / off["turns_per_s"],
        }
        rep["on_vs_off"] = cmp
        goals["ttft_p50_beats_claim"] = cmp["ttft_p50_reduction"] > CLAIMED_TTFT_REDUCTION
        goals["ttft_p90_beats_claim"] = cmp["ttft_p90_reduction"] > CLAIMED_TTFT_REDUCTION
        goals["throughput_beats_claim"] = cmp["output_throughput_ratio"] > CLAIMED_THROUGHPUT_RATIO
        rep["greedy_agreement"] = agreement(runs["on"], runs["off"])
    rep["goals"] = goals
    rep["turn_records"] = {
        k: [{f: v for f, v in asdict(r).items() if f != "prompt_token_ids"} for r in run.turns]
        for k, run in runs.items()
    }
    rep["steps_columns"] = ["start_s", "seconds", "num_batched_tokens", "num_sampled"]
    rep["steps"] = {k: [[round(x, 6) for x in st] for st in run.step_log] for k, run in runs.items()}
    return rep


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("BEATS the claim" if ok else "does NOT beat the claim")


def print_report(rep: dict[str, Any]) -> None:
    w, runs = rep["workload"], rep["runs"]
    print()
    print(
        f"== prefix caching: customer-service dialogues, {Path(rep['model']).name}, fp32, "
        f"{rep['torch']['threads']} torch threads =="
    )
    print(
        f"workload: {w['conversations']} conversations, {w['turns']} turns (3-5 each), one shared system "
        f"prompt of {w['system_prompt_tokens']} tokens; concurrency {rep['args']['concurrency']} (closed loop); "
        f"{rep['sampling']['max_tokens']} output tokens per turn (greedy, ignore_eos)"
    )
    print(f"load average at start/end: {rep['loadavg']}")
    print()
    cols = [k for k in ("on", "off") if k in runs]
    head = {"on": "caching ON", "off": "caching OFF"}
    print(f"{'':32}" + "".join(f"{head[c]:>14}" for c in cols))

    def row(label: str, key: str, fmt: str, scale: float = 1) -> None:
        print(f"{label:32}" + "".join(f"{format(runs[c][key] * scale, fmt):>14}" for c in cols))

    row("TTFT p50 (ms)", "ttft_p50_s", ".1f", 1e3)
    row("TTFT p90 (ms)", "ttft_p90_s", ".1f", 1e3)
    row("TTFT mean (ms)", "ttft_mean_s", ".1f", 1e3)
    row("TTFT p50, turns 2+ (ms)", "ttft_p50_turn2plus_s", ".1f", 1e3)
    row("TTFT p90, turns 2+ (ms)", "ttft_p90_turn2plus_s", ".1f", 1e3)
    row("latency p50 (ms)", "latency_p50_s", ".1f", 1e3)
    row("output tok/s", "output_tok_s", ".1f")
    row("turns/s", "turns_per_s", ".3f")
    row("wall time (s)", "wall_seconds", ".2f")
    row("mean prompt tokens", "mean_prompt_tokens", ".1f")
    row("prefix hit rate (%)", "hit_rate", ".1f", 100)
    row("reusable prefix, upper bd (%)", "reusable_rate", ".1f", 100)
    row("prompt tokens computed", "prompt_tokens_computed", "d")
    row("engine steps", "steps", "d")
    row("mean step time (ms)", "mean_step_ms", ".1f")
    row("mean steps to first token", "mean_steps_to_first_token", ".2f")
    row("preempted", "preempted", "d")
    row("client-side time (s)", "client_seconds", ".2f")
    print()
    print("TTFT p50 by turn (ms):")
    turns = sorted({int(k) for c in cols for k in runs[c]["by_turn"]})
    print(f"{'  turn':10}{'turns':>7}{'prompt tok':>12}" + "".join(f"{head[c]:>14}" for c in cols))
    for k in turns:
        first = runs[cols[0]]["by_turn"][k]
        print(
            f"{'  ' + str(k):10}{first['turns']:>7}{first['mean_prompt_tokens']:>12.1f}"
            + "".join(f"{1e3 * runs[c]['by_turn'][k]['ttft_p50_s']:>14.1f}" for c in cols)
        )
    cmp, goals = rep.get("on_vs_off"), rep["goals"]
    if cmp:
        print()
        claim_r, claim_x = 100 * CLAIMED_TTFT_REDUCTION, CLAIMED_THROUGHPUT_RATIO
        print(
            f"TTFT p50 reduction ON vs OFF: {100 * cmp['ttft_p50_reduction']:6.1f}%   "
            f"claimed -{claim_r:.0f}%: {_verdict(goals.get('ttft_p50_beats_claim'))}"
        )
        print(
            f"TTFT p90 reduction ON vs OFF: {100 * cmp['ttft_p90_reduction']:6.1f}%   "
            f"claimed -{claim_r:.0f}%: {_verdict(goals.get('ttft_p90_beats_claim'))}"
        )
        print(
            f"  turns 2+ only (past the cold first turn): p50 {100 * cmp['ttft_p50_turn2plus_reduction']:.1f}%, "
            f"p90 {100 * cmp['ttft_p90_turn2plus_reduction']:.1f}%"
        )
        print(
            f"output throughput ON / OFF:   {cmp['output_throughput_ratio']:6.2f}x   "
            f"claimed >= {claim_x:.0f}x: {_verdict(goals.get('throughput_beats_claim'))}"
        )
    agree = rep.get("greedy_agreement")
    if agree:
        print()
        print(
            f"greedy agreement ON vs OFF: {agree['identical_outputs']}/{agree['turns']} turns with identical "
            f"outputs, {agree['identical_prompts']}/{agree['turns']} identical prompts, "
            f"{agree['tokens_before_first_divergence']}/{agree['tokens']} tokens before the first divergence"
            + (f"; diverged: {agree['diverged'][:8]}" if agree["diverged"] else "")
        )
    print()


def _plot(report: Report, rep: dict[str, Any]) -> None:
    fig = report.figure(width=7, height=4.5)
    if fig is None:
        return
    ax = fig.axes[0]
    for label, records in rep["turn_records"].items():
        ttft = sorted(1e3 * r["ttft_s"] for r in records)
        ax.step(
            ttft,
            [(i + 1) / len(ttft) for i in range(len(ttft))],
            where="post",
            label=f"caching {label.upper()}",
        )
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of turns")
    ax.set_title("TTFT distribution", fontsize=9)
    ax.legend(fontsize=8)
    report.save_figure(fig)
