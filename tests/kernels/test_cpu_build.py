"""The C++ kernels' build (kernels/src/pagedserve/kernels/cpu_ext.py): a folder per content digest shared by every
checkout, built from staged copies of the sources, under an flock the OS releases when its
holder dies, so an interrupted build never blocks a later start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.kernels import cpu_ext

REPO = Path(__file__).resolve().parents[2]
LOAD = (
    "from pagedserve.kernels.cpu_ext import load_cpu_kernels\n"
    "kernels = load_cpu_kernels(strict=True, isa='portable')\n"
    "print('loaded', kernels.library_path)\n"
)


def test_the_build_name_is_the_sources_content_not_their_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = cpu_ext.build_name("avx2", ["-O3"])
    other = tmp_path / "other-checkout" / "cpu"
    shutil.copytree(Path(cpu_ext.__file__).parent / "cpu", other)
    monkeypatch.setattr(cpu_ext, "_SOURCES", tuple(other / p.name for p in cpu_ext._SOURCES))
    monkeypatch.setattr(cpu_ext, "_HEADERS", tuple(other / p.name for p in cpu_ext._HEADERS))
    assert cpu_ext.build_name("avx2", ["-O3"]) == name  # another checkout, same sources: same build
    assert cpu_ext.build_name("avx2", ["-O2"]) != name
    assert cpu_ext.build_name("portable", ["-O3"]) != name
    header = other / "vec.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert cpu_ext.build_name("avx2", ["-O3"]) != name  # a changed header is a new build


def _start(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LOAD],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_an_interrupted_build_never_blocks_the_next_start(tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = _start(env)
    # Interrupt it mid-build: once its objects start to appear (the compiler is running).
    deadline = time.monotonic() + 240
    root = tmp_path / "pagedserve"
    while not list(root.glob("*/src")) and first.poll() is None:
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(first.pid, sig)
    first.communicate(timeout=60)
    (folder,) = root.iterdir()
    assert not (folder / f"{folder.name}.so").exists()
    # What an interrupted torch build leaves behind: its lock file. It must not matter.
    (folder / "lock").touch()

    second = _start(env)
    out, err = second.communicate(timeout=300)  # a hang guard, not a speed check
    assert second.returncode == 0, err
    assert out.startswith("loaded ") and "building the C++ CPU kernels" in err
    ninja = (folder / "build.ninja").read_text()
    assert str(Path(cpu_ext.__file__).parent / "cpu") not in ninja  # built from the staged copies
    assert str(folder / "src") in ninja

    third = _start(env)  # a restart: the library is loaded as it is, nothing built or locked
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0, err
    assert "building" not in err and out.strip() == f"loaded {folder / (folder.name + '.so')}"
