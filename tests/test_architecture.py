"""The house plan, checked: import layers point down only, and no module imports itself back.

Layers from the top (docs/architecture.md):

    shell      pagedserve.cli, pagedserve.serve, pagedserve.models_cli, pagedserve.kernels_cli, pagedserve.__main__
    tools      benchmarks
    planes     controlplane, dataplane, clients (the Python client library)
    neutral    pagedserve.common (and the bare `pagedserve` package), kernels
    wire       protos

A module may import its own top-level area and any lower layer. The planes do not import each
other, `kernels` imports nothing from serving code, and the control plane never imports torch.
Every import statement counts: at module level, inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AREAS = ("pagedserve", "controlplane", "dataplane", "clients", "kernels", "benchmarks", "protos")
SHELL_MODULES = (
    "pagedserve.cli",
    "pagedserve.serve",
    "pagedserve.models_cli",
    "pagedserve.kernels_cli",
    "pagedserve.__main__",
)
LAYER = {"shell": 4, "benchmarks": 3, "controlplane": 2, "dataplane": 2, "clients": 2}
LAYER |= {"common": 1, "kernels": 1, "protos": 0}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for area in AREAS:
        for path in (ROOT / area).rglob("*.py"):
            if "pagedserve/v1" in path.as_posix():  # generated protobuf code imports only protobuf
                continue
            found[module_name(path)] = path
    return found


MODULES = our_modules()


def area_of(module: str) -> str:
    """The import-layer key of a module: 'shell', 'common', or its top-level package."""
    top = module.split(".")[0]
    if top == "pagedserve":
        if module.startswith(SHELL_MODULES):
            return "shell"
        return "common"  # pagedserve.common.* and the bare package (its version only)
    return top


def _resolve(name: str) -> str | None:
    """The module of ours an imported dotted name refers to (a module, else its package)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(imported name, line) for every import statement in `module` (absolute or relative)."""
    path = MODULES[module]
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
    for expected in ("pagedserve.cli", "pagedserve.common.settings", "controlplane.dispatcher"):
        assert expected in MODULES
    assert "dataplane.config" in edges()["dataplane.engine.llm"]


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
            if area_of(module) == "kernels" and top in AREAS and top not in ("kernels",):
                bad.append(f"{module}:{line} imports {name}")
            if area_of(module) == "controlplane" and top in ("torch", "triton", "transformers"):
                bad.append(f"{module}:{line} imports {name}")
    assert bad == []


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
    """A module's second-level package (`dataplane.kvcache.block_pool` -> `dataplane.kvcache`);
    modules directly in an area, and the area itself, stand for themselves."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles() -> None:
    assert find_cycle(edges()) is None


def test_no_import_cycles_between_packages() -> None:
    # kvcache <-> scheduler, kernels <-> kernels.triton_ops: cycles a module graph can hide.
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
