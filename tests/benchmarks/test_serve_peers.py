"""`pagedserve bench serve --launch / --peer vllm --repeats N`: interleaved rounds, each one's
ratio, the median round in the side-by-side table, and our text checked across rounds.

No server is launched: rounds are built from fake outcomes (`summarize` gives their figures),
and the one test of the round loop replaces `measure` (launch, warm up, drive, stop).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks import serve, serve_peers, serve_peers_report
from pagedserve.benchmarks.report import Report
from pagedserve.benchmarks.serve_load import Outcome, summarize
from pagedserve.benchmarks.serve_peers_report import ServedRun
from pagedserve.benchmarks.server_process import ServerSpec
from pagedserve.cli import main

OURS, PEER = "pagedserve serve", "vLLM serve"
# Token arrival times of two requests (3 + 2 = 5 tokens): ITL gaps 100, 200, 100 ms for ours
# (p50 100), twice that for the peer (p50 200).
OUR_TIMES = ([0.1, 0.2, 0.4], [0.3, 0.4])
PEER_TIMES = ([0.2, 0.4, 0.8], [0.6, 0.8])


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def outcomes(times: tuple[list[float], ...], texts: tuple[str | None, ...]) -> list[Outcome]:
    """One outcome per request; a text of None is a request that failed."""
    out = []
    for index, (ts, text) in enumerate(zip(times, texts, strict=True)):
        if text is None:
            out.append(Outcome(5, 0.0, ts[:1], error="RuntimeError: HTTP/1.1 500", index=index))
        else:
            out.append(Outcome(5, 0.0, ts, finished=True, index=index, usage_prompt_tokens=5, text=[text]))
    return out


def served(
    name: str, wall: float, times: tuple[list[float], ...], texts: tuple[str | None, ...]
) -> ServedRun:
    """A run of 5 tokens in `wall` seconds: 5 / wall output tok/s."""
    outs = outcomes(times, texts)
    summary = summarize(outs, wall, ttft_slo_ms=2000.0, tpot_slo_ms=1000.0)
    spec = ServerSpec(name, ["serve"], 8000, None, {"threads": 2})
    return ServedRun(spec, Path(f"/logs/{name.split()[0]}.log"), 1.0, wall, outs, summary, ((0.5,), (1.5,)))


def pair(
    our_wall: float, peer_wall: float, our_texts: tuple[str | None, ...] = ("abc", "de")
) -> list[ServedRun]:
    return [served(OURS, our_wall, OUR_TIMES, our_texts), served(PEER, peer_wall, PEER_TIMES, ("abc", "de"))]


def three_rounds() -> list[list[ServedRun]]:
    # ours / peer output tok/s: 10 / 8 = 1.25x, 5 / 10 = 0.5x, 10 / 8.33 = 1.2x (the median:
    # round 3); our text of request 1 changes in round 3.
    return [pair(0.5, 0.625), pair(1.0, 0.5), pair(0.5, 0.6, ("abc", "dX"))]


def launch_args(*argv: str) -> argparse.Namespace:
    args = parse("--launch", *argv)
    serve_peers.validate(args)
    return args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peer", "vllm", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--launch", "--repeats", "-2"], "--repeats must be >= 1, got -2"),
        (["--repeats", "3"], "--repeats: needs --launch or --peer"),  # a running server
    ],
)
def test_bad_repeats_are_named(argv: list[str], message: str) -> None:
    args = parse(*argv)
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_peers.validate(args)


def test_repeats_defaults_to_one_and_is_refused_before_any_server_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse().repeats == 1 and launch_args("--repeats", "3").repeats == 3
    assert main(["bench", "serve", "--peer", "vllm", "--repeats", "0", "--no-progress"]) == 1
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


def test_text_changed_counts_requests_not_identical_to_round_1() -> None:
    same = outcomes(OUR_TIMES, ("abc", "de"))
    assert serve_peers_report.text_changed([same, outcomes(OUR_TIMES, ("abc", "de"))]) == 0
    assert serve_peers_report.text_changed([same, same, outcomes(OUR_TIMES, ("abc", "dX"))]) == 1
    assert serve_peers_report.text_changed([same, outcomes(OUR_TIMES, (None, "de"))]) == 1  # failed later
    assert (
        serve_peers_report.text_changed([outcomes(OUR_TIMES, (None, "de")), same]) == 1
    )  # failed in round 1
    assert serve_peers_report.text_changed([same, outcomes(OUR_TIMES, ("x", "y"))]) == 2


def test_rounds_report_takes_each_ratio_and_the_median_round() -> None:
    rep = serve_peers_report.rounds_report(three_rounds())
    ratios = [f["ratio"] for f in rep["rounds"]]
    assert ratios == [pytest.approx(1.25), pytest.approx(0.5), pytest.approx(1.2)]
    first = rep["rounds"][0]
    assert (first["round"], first["ours_output_tok_s"], first["peer_output_tok_s"]) == (1, 10.0, 8.0)
    assert (first["ours_itl_p50_ms"], first["peer_itl_p50_ms"]) == (
        pytest.approx(100.0),
        pytest.approx(200.0),
    )
    assert (first["ours_failed"], first["peer_failed"]) == (0, 0)
    assert rep["median_round"] == 3 and rep["median_ratio"] == pytest.approx(1.2)
    assert rep["median_ratio_meets_goal"] is True  # 1.2 >= GOAL_RATIO 1.1
    assert rep["our_text_changed"] == 1


def test_an_even_count_quotes_the_mean_of_the_middle_ratios_but_shows_a_round_that_ran() -> None:
    # Ratios 1.0, 2.0, 0.5, 1.5: median 1.25; the table shows the lower middle one, round 1's 1.0.
    rounds = [pair(1.0, 1.0), pair(0.5, 1.0), pair(1.0, 0.5), pair(1.0, 1.5)]
    rep = serve_peers_report.rounds_report(rounds)
    assert rep["median_ratio"] == pytest.approx(1.25) and rep["median_round"] == 1
    # Below the goal: ratios 1.0 and 1.05 (4.0 / 3.81) of two rounds, median 1.025.
    rep = serve_peers_report.rounds_report([pair(1.0, 1.0), pair(1.25, 1.3125)])
    assert rep["median_ratio"] == pytest.approx(1.025) and rep["median_ratio_meets_goal"] is False
    assert rep["median_round"] == 1


def test_without_a_peer_rounds_rank_by_our_tok_s() -> None:
    rounds = [[served(OURS, wall, OUR_TIMES, ("abc", "de"))] for wall in (0.5, 1.0, 0.625)]  # 10, 5, 8 tok/s
    rep = serve_peers_report.rounds_report(rounds)
    assert rep["median_round"] == 3 and rep["median_ratio"] is None
    assert rep["median_ratio_meets_goal"] is None and rep["our_text_changed"] == 0
    assert rep["rounds"][1]["peer_output_tok_s"] is None and rep["rounds"][1]["ratio"] is None
    header, rows, notes = serve_peers_report.rounds_table([OURS], rep, 2)
    assert header == ["round", "pagedserve serve tok/s", "pagedserve serve ITL p50 ms"]
    assert rows == [
        ["1", "10.0", "100.0"],
        ["2", "5.0", "100.0"],
        ["3", "8.0", "100.0"],
        ["median", "8.0", ""],
    ]
    assert notes[-1] == (
        "pagedserve serve completion text changed from round 1 (or not completed): 0/2 requests (greedy: expected 0)"
    )


def test_the_rounds_table_lists_each_round_then_the_median_and_the_goal() -> None:
    header, rows, notes = serve_peers_report.rounds_table(
        [OURS, PEER], serve_peers_report.rounds_report(three_rounds()), 2
    )
    assert header == [
        "round",
        "pagedserve serve tok/s",
        "vLLM serve tok/s",
        "ratio",
        "pagedserve serve ITL p50 ms",
        "vLLM serve ITL p50 ms",
    ]
    assert rows == [
        ["1", "10.0", "8.0", "1.25x", "100.0", "200.0"],
        ["2", "5.0", "10.0", "0.50x", "100.0", "200.0"],
        ["3", "10.0", "8.3", "1.20x", "100.0", "200.0"],
        ["median", "", "", "1.20x", "", ""],
    ]
    assert notes[1] == "ratio = output tok/s pagedserve serve / vLLM serve; median 1.20x, goal >= 1.1x met"
    assert notes[2].endswith("changed from round 1 (or not completed): 1/2 requests (greedy: expected 0)")


def report_args() -> argparse.Namespace:
    return argparse.Namespace(concurrency=16, request_rate=math.inf, warmup=4)


def test_the_side_by_side_table_is_the_median_round_and_the_json_gains_the_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = Report("serve", None, ["test"])
    result = serve_peers_report._report(report_args(), report, Path("/models/m"), "2 prompts", three_rounds())
    main_table, rounds_table = report.tables
    table = {row[0]: row[1:] for row in main_table["rows"]}
    assert table["output tok/s"] == ["10.0", "8.3", "1.20x"]  # round 3, not round 1 (1.25x)
    assert main_table["notes"][0] == "output tok/s pagedserve serve / vLLM serve: 1.20x, goal >= 1.1x met"
    assert main_table["notes"][1] == (
        "median of 3 interleaved rounds by output tok/s pagedserve serve / vLLM serve: round 3 "
        '(every round in "Rounds, interleaved")'
    )
    assert rounds_table["title"] == "Rounds, interleaved" and len(rounds_table["rows"]) == 4
    assert [r["round"] for r in result["rounds"]] == [1, 2, 3]
    assert result["median_ratio"] == pytest.approx(1.2) and result["median_round"] == 3
    assert result["our_text_changed"] == 1
    assert result["same_text"] == 1  # round 3: our request 1 says "dX", the peer's "de"
    assert result["ratios"]["output tok/s"] == pytest.approx(1.2)
    assert "## Rounds, interleaved" in capsys.readouterr().out


def test_one_round_reports_as_before_without_rounds() -> None:
    report = Report("serve", None, ["test"])
    result = serve_peers_report._report(
        report_args(), report, Path("/models/m"), "2 prompts", [pair(0.5, 0.625)]
    )
    (table,) = report.tables
    assert table["title"] == "served over the OpenAI API, 16 streams"
    assert table["notes"][0] == "output tok/s pagedserve serve / vLLM serve: 1.25x, goal >= 1.1x met"
    assert not any("interleaved" in note for note in table["notes"])
    assert set(result) == {"mode", "workload", "model", "ratios", "same_text", "servers", "kernels_selected"}


def test_rounds_interleave_fresh_servers_on_the_same_workload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--peer", "vllm", "--repeats", "2", "--workload", "random", "--input-len", "4"]
    args = parse(*argv, "--num-prompts", "2", "--warmup", "1")
    args.api, args.concurrency, args.vllm_python, args.vllm_version = (
        "openai",
        16,
        "/peer/bin/python",
        "0.32.0",
    )
    monkeypatch.setattr("pagedserve.common.models.resolve_model_path", lambda name: tmp_path / "model")
    calls: list[dict[str, Any]] = []

    def fake_measure(
        args: argparse.Namespace,
        spec: ServerSpec,
        log: Path,
        prompts: list[list[int]],
        lengths: list[int],
        warm: list[list[int]],
        report: Report,
    ) -> ServedRun:
        calls.append({"name": spec.name, "log": log.name, "work": (prompts, lengths, warm)})
        times = OUR_TIMES if spec.name == OURS else PEER_TIMES
        return served(spec.name, 0.5 + 0.125 * len(calls), times, ("abc", "de"))

    monkeypatch.setattr(serve_peers, "measure", fake_measure)
    report = Report("serve", tmp_path / "out", ["test"])
    result = serve_peers.run_launched(args, report)
    names = [c["name"] for c in calls]
    assert names == [OURS, "vLLM serve 0.32.0", OURS, "vLLM serve 0.32.0"]
    logs = ["pagedserve-serve-round1.log", "vllm-serve-round1.log"]
    assert [c["log"] for c in calls] == [*logs, "pagedserve-serve-round2.log", "vllm-serve-round2.log"]
    assert all(c["work"] == calls[0]["work"] for c in calls)  # same prompts, lengths and warm-up
    assert len(calls[0]["work"][0]) == 2 and len(calls[0]["work"][2]) == 1
    # Walls 0.625 / 0.75 (1.2x), then 0.875 / 1.0 (1.14x): median of two, the lower ratio shown.
    assert result["median_ratio"] == pytest.approx((1.2 + 8 / 7) / 2) and result["median_round"] == 2
    err = capsys.readouterr().err
    assert err.index("pagedserve serve, round 1 ...") < err.index("vLLM serve 0.32.0, round 1 ...")
    assert err.index("vLLM serve 0.32.0, round 1 ...") < err.index("pagedserve serve, round 2 ...")
