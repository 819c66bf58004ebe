"""`--cap-isa avx2`: the environment every process of the run gets, and what it does to a
child interpreter's torch (vLLM reads torch.cpu to pick its AVX2 or AVX-512 kernels)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.benchmarks.isa_cap import SITE_DIR, active_cap, cap_env
from pagedserve.kernels.cpu_isa import cpu_flags

PROBE = (
    "import torch, torch.cpu; "
    "print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), "
    "torch.cpu._is_amx_tile_supported(), torch.backends.cpu.get_cpu_capability())"
)


def test_cap_env_caps_every_engine_and_keeps_the_callers_path() -> None:
    env = cap_env("avx2", {"PYTHONPATH": "/a:/b", "HOME": "/h"})
    assert env["PAGEDSERVE_CPU_ISA"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/a", "/b"]
    assert env["HOME"] == "/h"
    assert (SITE_DIR / "sitecustomize.py").is_file()  # shipped with the package


def test_an_unknown_cap_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--cap-isa must be one of avx2"):
        cap_env("sse2", {})


def test_a_capped_child_sees_no_avx512_and_an_uncapped_one_is_untouched() -> None:
    capped = subprocess.run(
        [sys.executable, "-c", PROBE], env=cap_env("avx2", dict(os.environ)), capture_output=True, text=True
    )
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.split() == ["False", "False", "False", "AVX2"]
    plain = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=dict(os.environ)
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split()[3] != "AVX2" or "avx512f" not in cpu_flags()


def test_active_cap_reads_the_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_BENCH_ISA_CAP", raising=False)
    assert active_cap() is None
    for key, value in cap_env("avx2", {}).items():
        monkeypatch.setenv(key, value)
    assert active_cap() == "avx2"
