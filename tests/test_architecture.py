"""The house plan, checked: one import namespace, import layers point down only, and no module
imports itself back.

Every module imports as `pagedserve.…`. The area folders sit at the top of the repository and
`pagedserve/<area>` links to each (docs/architecture.md). Layers from the top:

    shell      pagedserve.cli, pagedserve.serve, pagedserve.models_cli, pagedserve.kernels_cli, pagedserve.__main__
    tools      pagedserve.benchmarks
    planes     pagedserve.controlplane, pagedserve.dataplane, pagedserve.clients (the Python client library)
    neutral    pagedserve.common (and the bare `pagedserve` package), pagedserve.kernels
    wire       pagedserve.protos

A module may import its own area and any lower layer. The planes do not import each other,
`pagedserve.kernels` imports nothing from serving code, and the control plane never imports torch.
Every import statement counts: at module level, inside functions and under TYPE_CHECKING. The
one exception is the offline API's lazy re-export in `pagedserve/__init__.py` (its `__getattr__`
loads `LLM` from the data plane on first use, and TYPE_CHECKING names it for type checkers;
importing the package loads no plane).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders at the top of the repository that are areas of the `pagedserve` namespace.
AREAS = ("controlplane", "dataplane", "clients", "kernels", "benchmarks", "protos")
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
    """The dotted name a file imports as: `dataplane/kvcache/block_pool.py` ->
    `pagedserve.dataplane.kvcache.block_pool`; tests and helm keep their folder names."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if parts[0] in AREAS:
        parts = ("pagedserve", *parts)
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
    for path in (ROOT / "pagedserve").rglob("*.py"):
        # pagedserve/<area> links to the area's folder: each file is read once, where it lives.
        if not any(parent.is_symlink() for parent in path.relative_to(ROOT).parents if parent != Path(".")):
            found[module_name(path)] = path
    for area in AREAS:
        for path in _files(ROOT / area):
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


def _lazy_reexports(tree: ast.Module) -> set[int]:
    """Lines of the import statements inside a module-level `__getattr__` or `if TYPE_CHECKING:`
    (the offline API's names, loaded on first use and typed for a type checker)."""
    blocks = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        or (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    ]
    return {
        node.lineno
        for block in blocks
        for node in ast.walk(block)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(imported name, line) for every import statement in `module` (absolute or relative)."""
    path = EVERY_MODULE[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    lazy = _lazy_reexports(tree) if module == "pagedserve" else set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in lazy:
            continue
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


def test_the_offline_api_is_the_only_lazy_reexport() -> None:
    # The exemption above covers exactly the offline API's names, loaded on first use.
    tree = ast.parse(MODULES["pagedserve"].read_text())
    lazy = _lazy_reexports(tree)
    named = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.lineno in lazy
    }
    assert named == {
        "pagedserve.common.sampling_params",
        "pagedserve.dataplane.engine",
        "pagedserve.dataplane.engine.llm",
    }


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


def test_every_area_is_linked_into_the_namespace() -> None:
    for area in AREAS:
        link = ROOT / "pagedserve" / area
        assert link.is_symlink() and link.resolve() == (ROOT / area).resolve(), link


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
