"""Kernel tests run the Triton kernels on the GPU when there is one, else in Triton's CPU
interpreter. TRITON_INTERPRET must be set before the first @triton.jit module is imported
(pagedserve.kernels.triton_ops is imported lazily, on the first Triton call), hence here.

PAGEDSERVE_KERNEL_TESTS=cuda (what benchmarks/src/pagedserve/benchmarks/gpu_check.sh sets) makes that fallback an
error instead: a GPU check that silently ran in the interpreter would report a pass for
kernels it never compiled.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from pagedserve.kernels.cpu_ext import CpuKernels

REQUIRE = os.environ.get("PAGEDSERVE_KERNEL_TESTS", "")

if REQUIRE not in ("", "cuda"):
    raise pytest.UsageError(f"PAGEDSERVE_KERNEL_TESTS must be 'cuda' or unset, got {REQUIRE!r}")
if REQUIRE == "cuda":
    if not torch.cuda.is_available():
        raise pytest.UsageError("PAGEDSERVE_KERNEL_TESTS=cuda, but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET"):
        raise pytest.UsageError("PAGEDSERVE_KERNEL_TESTS=cuda runs compiled kernels: unset TRITON_INTERPRET")
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _runnable_isas() -> tuple[str, ...]:
    # Imported here, not at the top: TRITON_INTERPRET must be settled before kernels' imports
    # (pagedserve.kernels.cpu_ext imports no Triton module).
    from pagedserve.kernels.cpu_isa import runnable_isas

    return runnable_isas()


@pytest.fixture(scope="session", params=_runnable_isas())
def ext(request: pytest.FixtureRequest) -> CpuKernels:
    """The C++ CPU kernels, once per instruction-set build this CPU executes (avx512, avx2,
    portable: pagedserve.kernels.cpu_isa.CPU_ISAS), so every kernel test covers every ISA variant the
    machine can run. They must build here (a missing kernel is a failure, not a skip)."""
    from pagedserve.kernels.cpu_ext import load_cpu_kernels

    kernels = load_cpu_kernels(strict=True, isa=request.param)
    assert kernels is not None and kernels.isa == request.param
    return kernels
