"""`bench serve --peer`, the report: each served run's figures, the two servers side by side
per round and over rounds (ratios, text agreement), the kernel table from our server's log,
and the plot."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.common import (
    cpu_line,
    selection_table,
)
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.server_process import ServerSpec

GOAL_RATIO = 1.1  # issue 13: pagedserve >= 1.1x vLLM served, output tok/s at 16 streams


@dataclass
class ServedRun:
    spec: ServerSpec
    log: Path
    ready_s: float  # launch until /health said 200
    wall_s: float
    outcomes: list[Any]  # pagedserve.benchmarks.serve.Outcome, one per request sent
    summary: dict[str, Any]
    loads: tuple[tuple[float, ...], tuple[float, ...]]  # load average before / after


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
