"""The data plane sets libgomp's spin count before torch loads (dataplane/src/pagedserve/dataplane/server/openmp.py):
idle OpenMP threads then spin only that long, an explicit GOMP_SPINCOUNT wins, and a libgomp
already loaded keeps its own (with a warning). Each case runs in a fresh interpreter, since
libgomp reads the variable once, when it is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch  # noqa: F401  (loads libgomp here, so the fixture can tell whether torch uses it)

from pagedserve.dataplane.config import OMP_SPIN_COUNT, DataPlaneConfig
from pagedserve.dataplane.server.openmp import loaded_libgomp

# After one 2-thread region, sleep: the worker spins (burning CPU) or sleeps (none).
IDLE_CPU = """
import json, os, sys, time
from pagedserve.dataplane.server.openmp import loaded_libgomp, set_spin_count
applied = set_spin_count(int(sys.argv[1]))
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(3):
    a @ a
start = os.times()
time.sleep(0.5)
end = os.times()
cpu = (end.user + end.system) - (start.user + start.system)
print(json.dumps({"applied": applied, "env": os.environ.get("GOMP_SPINCOUNT"), "cpu": cpu,
                  "libgomp": loaded_libgomp() is not None}))
"""


def run_with_stderr(
    code: str, *args: str, env: dict[str, str] | None = None
) -> tuple[dict[str, object], str]:
    """`code` in a fresh interpreter without GOMP_SPINCOUNT (unless `env` sets it): the JSON
    object its last line prints, and its stderr."""
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def run(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    return run_with_stderr(code, *args, env=env)[0]


@pytest.fixture(autouse=True)
def _needs_libgomp() -> None:
    if loaded_libgomp() is None:
        pytest.skip("this torch build does not use libgomp")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a spinning worker needs a second CPU")


def test_the_count_set_before_torch_loads_is_the_one_libgomp_spins() -> None:
    spinning = run(IDLE_CPU, str(10**11))  # ~forever: the idle worker spins through the sleep
    sleeping = run(IDLE_CPU, "0")  # the idle worker sleeps at once
    assert spinning["applied"] == spinning["env"] == str(10**11)
    assert sleeping["applied"] == sleeping["env"] == "0"
    assert spinning["libgomp"] and sleeping["libgomp"]
    assert float(spinning["cpu"]) > 0.15  # type: ignore[arg-type]
    assert float(sleeping["cpu"]) < 0.05  # type: ignore[arg-type]


def test_an_explicit_environment_variable_wins() -> None:
    got = run(IDLE_CPU, "0", env={"GOMP_SPINCOUNT": str(10**11)})
    assert got["applied"] == got["env"] == str(10**11)
    assert float(got["cpu"]) > 0.15  # type: ignore[arg-type]


def test_too_late_once_libgomp_is_loaded() -> None:
    code = """
import json, logging, os
logging.basicConfig(level=logging.WARNING)
import torch
torch.ones(2) @ torch.ones(2)
from pagedserve.dataplane.server.openmp import set_spin_count
print(json.dumps({"applied": set_spin_count(3000), "env": os.environ.get("GOMP_SPINCOUNT")}))
"""
    got, stderr = run_with_stderr(code)
    assert got == {"applied": None, "env": None}
    assert "libgomp is already loaded: GOMP_SPINCOUNT=3000 not applied" in stderr


def test_pagedserve_dataplane_sets_it_before_the_server_imports_torch() -> None:
    """The command's path up to the server (a stand-in `run` reports what it found)."""
    code = """
import json, os, sys, types
fake = types.ModuleType("pagedserve.dataplane.server.server")
def run(config, tls, token):
    print(json.dumps({"env": os.environ.get("GOMP_SPINCOUNT"), "torch": "torch" in sys.modules,
                      "setting": config.omp_spin_count}))
    return 0
fake.run = run
sys.modules["pagedserve.dataplane.server.server"] = fake
from pagedserve.cli import main
sys.exit(main(sys.argv[1:]))
"""
    assert run(code, "dataplane", "--omp-spin-count", "1234") == {
        "env": "1234",
        "torch": False,
        "setting": 1234,
    }
    assert run(code, "dataplane") == {"env": str(OMP_SPIN_COUNT), "torch": False, "setting": OMP_SPIN_COUNT}


def test_the_setting_is_bounded() -> None:
    assert DataPlaneConfig().omp_spin_count == OMP_SPIN_COUNT == 3000
    with pytest.raises(ValueError, match="omp_spin_count"):
        DataPlaneConfig(omp_spin_count=-1)
