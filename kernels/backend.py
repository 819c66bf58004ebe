"""Which implementation a kernel call uses: Triton on CUDA, torch (and C++) on the CPU.

"triton" on a CPU tensor works only in Triton's interpreter (TRITON_INTERPRET=1, which
must be set before the first Triton kernel module is imported: kernels.triton_ops is
imported lazily, on the first Triton call, for that reason). It is meant for tests.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

# "auto": Triton for CUDA tensors when Triton is installed, else torch; "torch": the torch
# reference path; "triton": the Triton kernels or an error.
KernelImpl = Literal["auto", "torch", "triton"]


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    if not triton_installed():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def triton_supports(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` in this process."""
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreting()


def why_not_triton(device: torch.device) -> str:
    if not triton_installed():
        return "triton is not installed (pip install 'pagedserve[triton]')"
    if device.type == "cpu":
        return "Triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 (tests only, slow)"
    return f"Triton kernels do not support {device.type} tensors"


def use_triton(impl: str, device: torch.device) -> bool:
    """Resolve impl for tensors on `device`; ValueError for "triton" where it cannot run."""
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_installed()
    if impl == "triton":
        if not triton_supports(device):
            raise ValueError(f"impl='triton' cannot run here: {why_not_triton(device)}")
        return True
    raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
