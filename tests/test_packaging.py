"""What each distribution puts on a user's path: parts of the one import namespace `pagedserve`,
the files each reads at run time, and dependencies that follow its imports (the client and the
control plane install without torch)."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from test_architecture import DISTRIBUTIONS, area_of, edges

from pagedserve.common.version import __version__

ROOT = Path(__file__).resolve().parent.parent
# Distribution name -> its folder.
FOLDERS = {
    tomllib.loads((ROOT / f / "pyproject.toml").read_text())["project"]["name"]: f for f in DISTRIBUTIONS
}
# What a plane without a model must never pull in.
MODEL_STACK = {"torch", "transformers", "triton", "xgrammar", "safetensors", "accelerate"}
CLIENT = ("pagedserve-protos", "pagedserve-client")
TORCH_FREE = ("pagedserve-protos", "pagedserve-client", "pagedserve-common", "pagedserve-controlplane")


def project(folder: str) -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    return data


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def requires(name: str) -> set[str]:
    deps = project(FOLDERS[name])["dependencies"]
    assert isinstance(deps, list)
    return {requirement_name(r) for r in deps}


def closure(name: str) -> set[str]:
    """Every distribution `name` installs, through ours to third-party ones."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in requires(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                if dep in FOLDERS:
                    todo.append(dep)
    return seen


def distribution_of(module: str) -> str:
    """The distribution whose src/ holds `module`."""
    parts = [
        (part.replace("/", "."), name) for name, folder in FOLDERS.items() for part in [DISTRIBUTIONS[folder]]
    ]
    best = max((p for p in parts if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best[1]


def test_every_distribution_has_the_one_version() -> None:
    for name, folder in FOLDERS.items():
        assert project(folder)["version"] == __version__, name
        deps = project(folder)["dependencies"]
        assert isinstance(deps, list)
        ours = [d for d in deps if requirement_name(d) in FOLDERS]
        assert all(d.endswith(f"=={__version__}") for d in ours), (name, ours)


def test_each_distribution_requires_the_distributions_it_imports() -> None:
    missing = []
    for module, targets in edges().items():
        here = distribution_of(module)
        for target in targets:
            there = distribution_of(target)
            if there != here and there not in requires(here):
                missing.append(f"{module} imports {target}: {here} must require {there}")
    assert sorted(set(missing)) == []


def test_the_client_and_the_control_plane_install_no_model_stack() -> None:
    for name in TORCH_FREE:
        assert closure(name) & MODEL_STACK == set(), name
    assert closure("pagedserve-client") == {"pagedserve-protos", "grpcio", "protobuf"}
    assert "torch" in closure("pagedserve-dataplane")
    assert set(FOLDERS) - {"pagedserve"} <= requires("pagedserve")


def test_the_torch_free_areas_are_the_torch_free_distributions() -> None:
    # The architecture test keeps torch out of the control plane's code; here its distribution.
    assert {area_of(m) for m in edges() if distribution_of(m) in TORCH_FREE} == {
        "protos",
        "common",
        "clients",
        "controlplane",
    }


def tracked_copy(destination: Path) -> Path:
    """The checkout's tracked files copied to `destination`: a build writes its build/ and
    egg-info beside the sources, which must not land in the checkout."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True)
    for name in listed.stdout.splitlines():
        source, target = ROOT / name, destination / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every distribution's wheel, built from the tracked files with the build backend that is
    already installed (no network, no isolated build environment)."""
    out = tmp_path_factory.mktemp("wheels")
    source = tracked_copy(tmp_path_factory.mktemp("source"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + [str(source / folder) for folder in FOLDERS.values()],
        check=True,
        capture_output=True,
    )
    built = {}
    for name in FOLDERS:
        (wheel,) = out.glob(f"{name.replace('-', '_')}-{__version__}-*.whl")
        built[name] = wheel
    return built


def names_in(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (meta,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(meta).decode())


def test_each_wheel_is_one_part_of_the_namespace(wheels: dict[str, Path]) -> None:
    for name, wheel in wheels.items():
        files = [n for n in names_in(wheel) if ".dist-info/" not in n]
        assert {n.split("/")[0] for n in files} == {"pagedserve"}, name
        assert "pagedserve/__init__.py" not in files, name  # PEP 420: no part owns the package
        part = DISTRIBUTIONS[FOLDERS[name]]
        assert all(n.startswith(part + "/") for n in files if name != "pagedserve"), name
        assert not any(n.startswith(("tests/", "pagedserve/tests/")) for n in files), name


def test_the_wheels_carry_what_the_package_reads_at_run_time(wheels: dict[str, Path]) -> None:
    kernels = set(names_in(wheels["pagedserve-kernels"]))
    for source in sorted((ROOT / "kernels/src/pagedserve/kernels/cpu").iterdir()):
        assert f"pagedserve/kernels/cpu/{source.name}" in kernels, source.name
    assert "pagedserve/benchmarks/data/schemas.json" in names_in(wheels["pagedserve-benchmarks"])
    protos = set(names_in(wheels["pagedserve-protos"]))
    assert {
        "pagedserve/protos/pagedserve/v1/generation_pb2.py",
        "pagedserve/protos/pagedserve/v1/common.proto",
    } <= protos


def required_by(wheel: Path) -> set[str]:
    """The distributions a wheel's METADATA requires, its extras left out."""
    listed = metadata(wheel).get_all("Requires-Dist") or []
    return {requirement_name(r) for r in listed if "extra ==" not in r}


def test_the_wheels_metadata_requires_no_torch_for_the_client_and_control_plane(
    wheels: dict[str, Path],
) -> None:
    for name in TORCH_FREE:
        assert required_by(wheels[name]) & MODEL_STACK == set(), name
    assert required_by(wheels["pagedserve-client"]) == {"pagedserve-protos", "grpcio", "protobuf"}


BLOCK_MODEL_STACK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed with this distribution")
sys.meta_path.insert(0, Block())
sys.path.insert(0, {target!r})
import pkgutil, importlib
import pagedserve.{area} as area
names = [m.name for m in pkgutil.walk_packages(area.__path__, area.__name__ + ".")]
for name in names:
    importlib.import_module(name)
assert len(names) > {least}, names
print(len(names))
"""


@pytest.mark.parametrize(
    ("dists", "area", "least"),
    [
        (("pagedserve-protos", "pagedserve-client"), "clients.python", 3),
        (("pagedserve-protos", "pagedserve-common", "pagedserve-controlplane"), "controlplane", 40),
    ],
    ids=["client", "controlplane"],
)
def test_the_installed_wheels_import_without_the_model_stack(
    wheels: dict[str, Path], tmp_path: Path, dists: tuple[str, ...], area: str, least: int
) -> None:
    # Only these wheels (no dependencies) in a target folder, and torch & co. unimportable: every
    # module of the area imports from what was installed.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
        + [str(wheels[d]) for d in dists],
        check=True,
        capture_output=True,
    )
    code = BLOCK_MODEL_STACK.format(blocked=MODEL_STACK, target=str(target), area=area, least=least)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_client_installs_alone_in_an_empty_venv(wheels: dict[str, Path], tmp_path: Path) -> None:
    # A real install from the package index (or pip's cache): what `pip install ./clients/python`
    # gives a user.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", *(str(wheels[d]) for d in CLIENT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True, text=True
    )
    installed = {requirement_name(line) for line in listed.stdout.split()}
    assert installed & MODEL_STACK == set()
    assert {"pagedserve-client", "pagedserve-protos", "grpcio", "protobuf"} <= installed
    helped = subprocess.run(
        [str(env_dir / "bin" / "pagedserve-client"), "generate", "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--stream" in helped.stdout, helped.stderr


def test_every_list_of_the_distributions_names_them_all() -> None:
    # A new distribution is one folder; the tools that list them all must agree with this test's list.
    folders = set(DISTRIBUTIONS)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    srcs = {f"{folder}/src".removeprefix("./") for folder in folders}
    assert set(config["pytest"]["ini_options"]["pythonpath"]) - {"."} == srcs
    assert set(config["ruff"]["src"]) - {"."} == srcs
    assert set(config["mypy"]["mypy_path"].split(":")) == srcs
    assert set(config["mypy"]["files"]) == {f"{src}/pagedserve" for src in srcs} | {"tests"}
    makefile = re.search(r"^DISTS := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile and set(makefile.group(1).split()) == folders - {"."}
    dockerignore = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    assert folders - {"."} <= dockerignore and "src" in dockerignore
