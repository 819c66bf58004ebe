"""Shared launcher helpers: dtype mapping, device checks, FP8 format constants."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.backend import triton_interpreting, triton_supports_dtype, why_not_triton

TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}

# (largest finite value, mantissa bits, smallest normal exponent) of each FP8 format.
FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}


def check_device(*tensors: torch.Tensor) -> bool:
    """Raise ValueError unless Triton can run on these tensors; returns whether it interprets."""
    device = tensors[0].device
    for t in tensors:
        if not triton_supports_dtype(t.dtype, t.device):
            raise ValueError(f"compiled Triton supports {t.dtype} only on sm_89+ GPUs")
    for t in tensors:
        if t.device != device:
            raise ValueError(f"Triton kernel inputs must share one device, got {t.device} and {device}")
    interpreting = triton_interpreting()
    if device.type == "cuda":
        return interpreting
    if device.type == "cpu" and interpreting:
        return True
    raise ValueError(why_not_triton(device))


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, n)))
