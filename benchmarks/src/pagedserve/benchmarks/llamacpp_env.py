"""The llama.cpp peer's own virtual environment, built on demand and cached outside the repository.

    pagedserve bench quantized --peers llama.cpp      # builds it the first time (20+ min on 2 cores)
    python -m pagedserve.benchmarks.llamacpp_env       # or build it ahead; prints its interpreter

`llama-cpp-python` from PyPI is a source distribution: pip compiles llama.cpp on this machine
(its default build targets this CPU, -march=native), which is what a CPU user of the GGUF
world runs. No torch in this venv.
"""

from __future__ import annotations

import sys

from pagedserve.benchmarks.peer_venv import PeerVenv, python_of

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP = PeerVenv(
    name=f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}",
    install=(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",),
    probe="import llama_cpp; print(llama_cpp.__version__)",
    size_note="compiles llama.cpp from source: 20+ min on 2 cores",
    with_torch=False,
)


def ensure_llamacpp_python(progress: bool = True) -> str:
    """The interpreter of a venv that imports llama_cpp, building the venv if needed."""
    return str(python_of(LLAMA_CPP.ensure(progress)))


def main() -> int:
    print(ensure_llamacpp_python())
    return 0


if __name__ == "__main__":
    sys.exit(main())
