"""`pagedserve kernels build`: the library a start would load, built or found, named on stdout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedserve.cli import build_parser, main
from pagedserve.kernels.cpu_isa import CPU_ISAS, runnable_isas, selected_isa


def test_build_names_the_library_a_start_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    found = re.search(rf"pagedserve kernels: {selected_isa()} ready in [0-9.]+ s: (\S+\.so)$", out, re.M)
    assert found is not None, out
    assert Path(found.group(1)).is_file()


def test_all_builds_every_level_this_cpu_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels", "build", "--isa", "all"]) == 0
    ready = re.findall(r"pagedserve kernels: (\S+) ready in", capsys.readouterr().out)
    assert ready == list(runnable_isas())


def test_every_build_level_is_a_choice_and_nothing_else() -> None:
    parser = build_parser()
    for isa in ("all", *CPU_ISAS):
        assert parser.parse_args(["kernels", "build", "--isa", isa]).isa == isa
    with pytest.raises(SystemExit):
        parser.parse_args(["kernels", "build", "--isa", "sse2"])
