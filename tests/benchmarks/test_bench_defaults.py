"""`pagedserve bench throughput` with no arguments is the quick run a newcomer is told to try:
a small workload through our engine, no peers; `--full` and any `--peers` / `--peer` keep the
standard 64-prompt comparison the README's figures come from. And the hint a run without
matplotlib prints names a command that installs it from a checkout. Plans only: nothing runs."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from pagedserve.benchmarks import throughput
from pagedserve.benchmarks.report import PLOT_EXTRA_HINT
from pagedserve.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def planned(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["bench", "throughput", *argv])
    throughput.plan(args)
    return args


def test_the_default_run_is_the_quick_workload_without_peers() -> None:
    args = planned()
    assert args.peers == [] and args.peer == []
    assert (args.num_prompts, args.max_output) == throughput.QUICK_WORKLOAD
    # small enough for a first look: a quarter of the standard workload's requests at most
    assert args.num_prompts <= throughput.FULL_WORKLOAD[0] // 4
    assert args.max_output <= throughput.FULL_WORKLOAD[1] // 2


def test_full_is_the_standard_comparison() -> None:
    args = planned("--full")
    assert args.peers == ["transformers", "transformers-cb"]
    assert (args.num_prompts, args.max_output) == throughput.FULL_WORKLOAD == (64, 256)


@pytest.mark.parametrize(
    ("argv", "peers"),
    [
        (["--peers", "vllm"], ["vllm"]),
        (["--peers"], []),  # our engine alone, on the standard workload (benchmarks/README.md)
        (["--peer", "transformers"], []),
        (["--full", "--peers", "transformers"], ["transformers"]),
    ],
)
def test_naming_peers_keeps_the_standard_workload(argv: list[str], peers: list[str]) -> None:
    args = planned(*argv)
    assert args.peers == peers
    assert (args.num_prompts, args.max_output) == throughput.FULL_WORKLOAD


def test_explicit_sizes_win() -> None:
    args = planned("--num-prompts", "3", "--max-output", "5", "--full")
    assert (args.num_prompts, args.max_output) == (3, 5)
    args = planned("--min-output", "200")  # above the quick default's longest output
    assert args.max_output == 200


def test_the_plot_hint_installs_the_bench_extra_the_way_the_readme_installs() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["bench"])
    command = re.search(r'pip install -e "\.\[(\w+)\]"', PLOT_EXTRA_HINT)
    assert command and command.group(1) == "bench", PLOT_EXTRA_HINT
    assert "pagedserve[" not in PLOT_EXTRA_HINT  # no such distribution on PyPI
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    # The README's own form: the checkout's distributions installed editable, the root with extras.
    assert "pip install -e ./protos" in install and '-e ".[' in install
