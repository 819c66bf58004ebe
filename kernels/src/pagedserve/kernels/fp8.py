"""FP8 KV cache formats: names, torch dtypes, and the quantization contract.

A pool stored in FP8 keeps 1 byte per element. Each layer has one K scale and one V scale
(per-tensor, fp32): the cache holds q = fp8(x / scale) and readers use q * scale.
Quantization saturates to the format's largest finite value and rounds to nearest even;
both implementations (torch here, Triton in pagedserve.kernels.triton_ops) multiply by the same fp32
reciprocal `inverse_scale(scale)`, so they produce bit-identical caches.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.names import KV_CACHE_DTYPES

# e4m3 "fn": no infinities, one NaN encoding, largest finite 448 (the OCP/NVIDIA format).
FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an FP8 dtype")
    return float(torch.finfo(dtype).max)


def is_rounded_cache(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
    """Whether K/V of `model_dtype` are stored rounded to a 16-bit cache of `cache_dtype`
    (an fp32 model's bf16 cache): a plain cast on write, exact widening on read, no scales."""
    return cache_dtype == torch.bfloat16 and model_dtype == torch.float32


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's dtype for "auto", bf16 for "bfloat16" (ValueError
    for a float16 model, whose values bf16 would round coarser), else the FP8 format."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bfloat16":
        if model_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype bfloat16 needs a float32 or bfloat16 model, got {model_dtype}")
        return torch.bfloat16
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def inverse_scale(scale: float) -> float:
    """1 / scale rounded to fp32: what every quantizer multiplies by (not a division, whose
    rounding differs between torch and GPU approximate-divide instructions)."""
    if not scale > 0.0 or scale == float("inf"):
        raise ValueError(f"KV scales must be positive and finite, got {scale}")
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference: fp8(clamp(x * fp32(1/scale), -max, max)), round-to-nearest-even.

    The explicit clamp is the saturation: torch's own cast saturates to e4m3fn but sends
    large values to inf in e5m2.
    """
    limit = fp8_max(dtype)
    scaled = x.to(torch.float32) * inverse_scale(scale)
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in `dtype` (fp32 arithmetic, then one rounding to `dtype`)."""
    return (q.to(torch.float32) * scale).to(dtype)
