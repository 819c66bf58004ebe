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


def triton_supports_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Compiled Triton has e4m3 (float8e4nv) only on sm_89+ (Ada, Hopper and later); e5m2,
    16/32-bit types and the interpreter work everywhere."""
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return True


def use_triton(impl: str, device: torch.device, cache_dtype: torch.dtype | None = None) -> bool:
    """Resolve impl for a cache of `cache_dtype` on `device`; ValueError for "triton" where
    it cannot run. "auto" falls back to torch for an e4m3 cache on a pre-sm_89 GPU."""
    if impl == "torch":
        return False
    dtype_ok = cache_dtype is None or triton_supports_dtype(cache_dtype, device)
    if impl == "auto":
        return device.type == "cuda" and triton_installed() and dtype_ok
    if impl == "triton":
        if not triton_supports(device):
            raise ValueError(f"impl='triton' cannot run here: {why_not_triton(device)}")
        if not dtype_ok:
            raise ValueError(f"impl='triton': compiled Triton supports {cache_dtype} only on sm_89+ GPUs")
        return True
    raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
