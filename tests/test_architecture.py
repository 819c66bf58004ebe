"""The house plan, checked: one import namespace, import layers point down only, and no module
imports itself back.

Every module imports as `pagedserve.…`, a PEP 420 namespace spread over one distribution per
area: each folder at the top of the repository holds its code in `src/pagedserve/<area>/`
(docs/architecture.md). Layers from the top:

    shell      pagedserve.cli, pagedserve.serve, pagedserve.models_cli, pagedserve.kernels_cli, pagedserve.__main__
    tools      pagedserve.benchmarks
    planes     pagedserve.controlplane, pagedserve.dataplane, pagedserve.clients (the Python client library)
    neutral    pagedserve.common, pagedserve.kernels
    wire       pagedserve.protos

A module may import its own area and any lower layer. The planes do not import each other,
`pagedserve.kernels` imports nothing from serving code, and the control plane never imports torch.
Every import statement counts: at module level, inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders at the top of the repository that are areas of the `pagedserve` namespace.
AREAS = ("controlplane", "dataplane", "clients", "kernels", "benchmarks", "protos")
# Each distribution's folder (its pyproject.toml) -> the part of the namespace under its src/:
# the areas, the plane-neutral code and the shell (the meta distribution at the root).
DISTRIBUTIONS = {
    "protos": "pagedserve/protos",
    "common": "pagedserve/common",
    "clients/python": "pagedserve/clients/python",
    "kernels": "pagedserve/kernels",
    "controlplane": "pagedserve/controlplane",
    "dataplane": "pagedserve/dataplane",
    "benchmarks": "pagedserve/benchmarks",
    ".": "pagedserve",
}
# The repository's own top-level names that nothing may import as such any more.
OLD_TOP_LEVEL = frozenset(AREAS)
SHELL_MODULES = (
    "pagedserve.cli",
    "pagedserve.serve",
    "pagedserve.models_cli",
    "pagedserve.kernels_cli",
    "pagedserve.__main__",
)
LAYER = {"shell": 4, "benchmarks": 3, "controlplane": 2, "dataplane": 2, "clients": 2}
LAYER |= {"common": 1, "kernels": 1, "protos": 0}
# Folders whose modules import ours but are not part of the package: they may import any layer.
OUTSIDE = ("tests", "helm")


def module_name(path: Path) -> str:
    """The dotted name a file imports as: `dataplane/src/pagedserve/dataplane/kvcache/block_pool.py` ->
    `pagedserve.dataplane.kvcache.block_pool`; tests and helm keep their folder names."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if "src" in parts and parts[0] not in OUTSIDE:
        parts = parts[parts.index("src") + 1 :]
    return ".".join(parts)


def _files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*.py")):
        if (
            "pagedserve/v1" in path.relative_to(ROOT).as_posix()
        ):  # generated protobuf code imports only protobuf
            continue
        yield path


def our_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, part in DISTRIBUTIONS.items():
        for path in _files(ROOT / folder / "src" / part):
            found[module_name(path)] = path
    return found


def outside_modules() -> dict[str, Path]:
    return {module_name(path): path for folder in OUTSIDE for path in _files(ROOT / folder)}


MODULES = our_modules()
EVERY_MODULE = MODULES | outside_modules()


def area_of(module: str) -> str:
    """The import-layer key of one of our modules: 'shell', 'common', or its area."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in AREAS:
        return parts[1]
    if module.startswith(SHELL_MODULES):
        return "shell"
    return "common"  # pagedserve.common.* and the bare package


def _resolve(name: str) -> str | None:
    """The module of ours an imported dotted name refers to (a module, else its package)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(imported name, line) for every import statement in `module` (absolute or relative)."""
    path = EVERY_MODULE[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno  # a submodule, or a name in `base`


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for name, _ in imports_of(module):
            target = _resolve(name)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def test_the_walker_sees_our_packages() -> None:
    # Guards the test itself: an empty or partial module list would make every check pass.
    for expected in (
        "pagedserve.cli",
        "pagedserve.common.settings",
        "pagedserve.controlplane.routing.dispatcher",
    ):
        assert expected in MODULES
    assert "pagedserve.dataplane.config" in edges()["pagedserve.dataplane.engine.llm"]


def test_imports_only_point_down() -> None:
    upward = []
    for module in MODULES:
        here = area_of(module)
        for name, line in imports_of(module):
            target = _resolve(name)
            if target is None:
                continue
            there = area_of(target)
            if there == here:
                continue
            if LAYER[there] >= LAYER[here]:
                upward.append(f"{module}:{line} imports {target} ({here} -> {there})")
    assert upward == []


def test_kernels_import_no_serving_code_and_the_control_plane_no_torch() -> None:
    bad = []
    for module in MODULES:
        for name, line in imports_of(module):
            top = name.split(".")[0]
            target = _resolve(name)
            if area_of(module) == "kernels" and target is not None and area_of(target) != "kernels":
                bad.append(f"{module}:{line} imports {name}")
            if area_of(module) == "controlplane" and top in ("torch", "triton", "transformers"):
                bad.append(f"{module}:{line} imports {name}")
    assert bad == []


def test_one_namespace_nothing_imports_the_old_top_level_names() -> None:
    # `import dataplane` from the repository root would still find the folder, and load a second
    # copy of every module beside `pagedserve.dataplane`: nothing may use those names.
    old = [
        f"{module}:{line} imports {name}"
        for module in EVERY_MODULE
        for name, line in imports_of(module)
        if name.split(".")[0] in OLD_TOP_LEVEL
    ]
    assert old == []


def test_no_product_or_tool_module_imports_tests() -> None:
    helm = {m for m in EVERY_MODULE if m.split(".")[0] == "helm"}
    bad = [
        f"{module}:{line} imports {name}"
        for module in sorted(MODULES.keys() | helm)
        for name, line in imports_of(module)
        if name.split(".")[0] == "tests"
    ]
    assert bad == []


def test_every_area_is_a_distribution_of_the_namespace() -> None:
    # One real package tree: no links, and no distribution ships pagedserve/__init__.py (one
    # that did would make `pagedserve` a regular package and hide every other part).
    for area in AREAS:
        assert any(folder.split("/")[0] == area for folder in DISTRIBUTIONS), area
    for folder, part in DISTRIBUTIONS.items():
        src = ROOT / folder / "src"
        assert (ROOT / folder / "pyproject.toml").is_file(), folder
        assert (src / part).is_dir() and not (src / "pagedserve" / "__init__.py").exists(), folder
        assert [p for p in src.rglob("*") if p.is_symlink()] == [], folder
        # (an editable install writes its *.egg-info beside the package: git ignores it)
        kept = sorted(p.name for p in src.iterdir() if p.name != "__pycache__" and p.suffix != ".egg-info")
        assert kept == ["pagedserve"], folder


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = dict.fromkeys(graph, 0)
    for start in sorted(graph):
        if state[start]:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state[child] == 1:
                return [*path[path.index(child) :], child]
            elif state[child] == 0:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def package_of(module: str) -> str:
    """A module's package one level below its area (`pagedserve.dataplane.kvcache.block_pool` ->
    `pagedserve.dataplane.kvcache`, `pagedserve.common.settings` -> `pagedserve.common`); modules
    directly in an area, and the area itself, stand for themselves."""
    parts = module.split(".")
    return ".".join(parts[:3] if len(parts) > 1 and parts[1] in AREAS else parts[:2])


def test_no_import_cycles() -> None:
    assert find_cycle(edges()) is None


def test_no_import_cycles_between_packages() -> None:
    # kvcache <-> scheduler, kernels <-> pagedserve.kernels.triton_ops: cycles a module graph can hide.
    graph: dict[str, set[str]] = {}
    for module, targets in edges().items():
        here = package_of(module)
        graph.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
        for t in targets:
            graph.setdefault(package_of(t), set())
    assert find_cycle(graph) is None


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set()}, None),
    ],
)
def test_find_cycle(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


MAX_MODULE_LINES = 500


def test_no_hand_written_module_over_500_lines() -> None:
    # Small modules: a file past this has seams to split along (generated protobuf code aside).
    helm = {m: p for m, p in EVERY_MODULE.items() if m.split(".")[0] == "helm"}
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted({*MODULES.values(), *helm.values()})
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []
