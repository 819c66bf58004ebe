"""Virtual environments for peers and outside tools, built on demand, cached outside the repo.

A peer (vLLM's CPU build) or a tool we test against (guidellm) is never our dependency: each
gets a venv of its own under `$PAGEDSERVE_PEERS_HOME` (default
`$XDG_CACHE_HOME/pagedserve/peers`), on the same CPU torch pin as ours (an unpinned torch pulls
a multi-GB CUDA build). A marker file is written only after the venv's probe imports the
package, so an interrupted build is redone, and a finished one is reused without pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

TORCH_PIN = "torch==2.13.0"  # our CPU pin (pyproject.toml)
READY_MARKER = ".pagedserve-ready"


def peers_home() -> Path:
    explicit = os.environ.get("PAGEDSERVE_PEERS_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pagedserve" / "peers"


def python_of(directory: Path) -> Path:
    return directory / "bin" / "python"


def ready(directory: Path) -> bool:
    return (directory / READY_MARKER).is_file() and python_of(directory).is_file()


@dataclass(frozen=True)
class PeerVenv:
    """One cached venv: its folder name, what pip installs, what it removes afterwards (wheels a
    dependency drags in that break the import), and a probe that prints the version."""

    name: str
    install: tuple[str, ...]
    probe: str
    size_note: str
    uninstall: tuple[str, ...] = ()
    with_torch: bool = True  # our torch pin first (a peer that needs no torch skips it)

    @property
    def directory(self) -> Path:
        return peers_home() / self.name

    def ensure(self, progress: bool = True) -> Path:
        """The venv's folder, building it first if it is not ready."""
        directory = self.directory
        if ready(directory):
            return directory
        out = sys.stderr if progress else subprocess.DEVNULL

        def pip(*args: str) -> None:
            subprocess.run(
                [str(python_of(directory)), "-m", "pip", "--disable-pip-version-check", *args],
                check=True,
                stdout=out,
                stderr=out,
            )

        print(f"building the {self.name} venv in {directory} (once; {self.size_note})", file=sys.stderr)
        directory.parent.mkdir(parents=True, exist_ok=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(directory)
        pip("install", "--quiet", *((TORCH_PIN,) if self.with_torch else ()), *self.install)
        if self.uninstall:
            pip("uninstall", "--quiet", "-y", *self.uninstall)
        probe = subprocess.run(
            [str(python_of(directory)), "-c", self.probe], capture_output=True, text=True, check=False
        )
        if probe.returncode != 0:
            raise RuntimeError(f"the {self.name} venv fails its probe:\n{probe.stderr[-2000:]}")
        (directory / READY_MARKER).write_text(probe.stdout)
        return directory
