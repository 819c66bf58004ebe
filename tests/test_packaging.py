"""What `pip install .` puts on a user's path: one import name, `pagedserve`, with the files the
package reads at run time (the C++ kernel sources and headers, the benchmark data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_copy(destination: Path) -> Path:
    """The checkout's tracked files (links kept as links) copied to `destination`: the build
    writes its build/ and egg-info beside the sources, which must not land in the checkout."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    for name in listed.stdout.splitlines():
        source, target = ROOT / name, destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = tracked_copy(tmp_path_factory.mktemp("source"))
    # The wheel `pip install .` installs, built from the tracked files with the build backend
    # that is already installed (no network, no isolated build environment).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("pagedserve-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_distribution_exposes_one_import_name(wheel: Path, wheel_names: list[str]) -> None:
    tops = {name.split("/")[0] for name in wheel_names if ".dist-info/" not in name}
    assert tops == {"pagedserve"}
    (top_level,) = (name for name in wheel_names if name.endswith(".dist-info/top_level.txt"))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(top_level).decode().split() == ["pagedserve"]
    with_areas = {name.split("/")[1] for name in wheel_names if name.startswith("pagedserve/")}
    assert {"controlplane", "dataplane", "kernels", "clients", "benchmarks", "protos", "common"} <= with_areas


def test_the_wheel_carries_what_the_package_reads_at_run_time(wheel_names: list[str]) -> None:
    names = set(wheel_names)
    for source in sorted((ROOT / "kernels" / "cpu").iterdir()):
        assert f"pagedserve/kernels/cpu/{source.name}" in names, source.name
    assert "pagedserve/benchmarks/data/schemas.json" in names
    assert "pagedserve/protos/pagedserve/v1/generation_pb2.py" in names
    assert not any(name.startswith(("tests/", "pagedserve/tests/")) for name in names)
