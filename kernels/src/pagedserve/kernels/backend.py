"""Which implementation each kernel op runs, decided once per engine.

One vocabulary:
- `Backend` ("torch" | "triton", pagedserve.kernels.names): what a user chooses (`--attention-backend`);
  None means by device: Triton for CUDA tensors when it is installed and supports the cache
  dtype, else torch.
- `AttentionImpl` ("torch" | "cpp" | "triton"): a concrete attention path. The torch backend
  runs "cpp" (the C++ decode and prefill kernels, pagedserve.kernels.cpu_ext; FP8 prefill stays torch)
  on the CPU for an fp32 model over an fp32, bf16 or FP8 (e4m3 / e5m2) cache when the kernels
  build, else "torch".
- `CacheWriteImpl` ("torch" | "cpp" | "triton"): write_kv_cache's path; where attention is
  "cpp" an fp32 or bf16 cache is written by the C++ copy too. Block copies and swaps have no third
  path: their concrete implementations are the two backends.
- `ResolvedBackends`: the concrete implementation of each op for one engine, from
  `resolve_backend`, called once when the model runner is built. Every layer call receives
  it, so the hot path never looks at the device, the dtypes or the C++ build again.

The public ops take these concrete names as `impl`; None there resolves by device on each
call, a convenience for tests and benchmarks, never the engine's path.

"triton" on a CPU tensor works only in Triton's interpreter (TRITON_INTERPRET=1, which
must be set before the first Triton kernel module is imported: pagedserve.kernels.triton_ops is
imported lazily, on the first Triton call, for that reason). It is meant for tests.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from pagedserve.kernels.cpu_ext import load_cpu_kernels
from pagedserve.kernels.fp8 import is_fp8, is_rounded_cache
from pagedserve.kernels.names import BACKENDS, Backend

AttentionImpl = Literal["torch", "cpp", "triton"]
ATTENTION_IMPLS: tuple[AttentionImpl, ...] = ("torch", "cpp", "triton")


# write_kv_cache's concrete paths: the two backends, and "cpp" (kernels/src/pagedserve/kernels/cpu/cache_ops.cpp), a
# plain copy for fp32 caches on the CPU, a rounding one for bf16 caches (FP8 caches quantize on
# write, in torch).
CacheWriteImpl = Literal["torch", "cpp", "triton"]


@dataclass(frozen=True)
class ResolvedBackends:
    """The concrete implementation of each op, for caches of one device and dtype."""

    attention: AttentionImpl
    cache: Backend  # block copies and swaps
    cache_write: CacheWriteImpl  # write_kv_cache


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


def require_triton(device: torch.device, cache_dtype: torch.dtype | None, who: str) -> None:
    """ValueError, naming `who` asked for Triton, unless its kernels run on this device and
    cache dtype."""
    if not triton_supports(device):
        raise ValueError(f"{who} cannot run here: {why_not_triton(device)}")
    if cache_dtype is not None and not triton_supports_dtype(cache_dtype, device):
        raise ValueError(f"{who}: compiled Triton supports {cache_dtype} only on sm_89+ GPUs")


def default_backend(device: torch.device, cache_dtype: torch.dtype | None = None) -> Backend:
    """The backend by device: Triton on CUDA when installed, except for an e4m3 cache on a
    pre-sm_89 GPU (torch then); torch elsewhere, the interpreter included (it is for tests)."""
    dtype_ok = cache_dtype is None or triton_supports_dtype(cache_dtype, device)
    return "triton" if device.type == "cuda" and triton_installed() and dtype_ok else "torch"


def cpp_cache_dtype(cache_dtype: torch.dtype) -> bool:
    """Whether the C++ decode kernel reads caches of this dtype (with an fp32 query)."""
    return cache_dtype in (torch.float32, torch.bfloat16) or is_fp8(cache_dtype)


def _torch_attention(
    device: torch.device, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> AttentionImpl:
    """The torch backend's attention: the C++ kernels for an fp32 query over an fp32, bf16 or
    FP8 cache on the CPU, if it builds (building it here, once, keeps the seconds-long first
    build out of the first step)."""
    supported = query_dtype == torch.float32 and cpp_cache_dtype(cache_dtype)
    if device.type == "cpu" and supported and load_cpu_kernels() is not None:
        return "cpp"
    return "torch"


def resolve_backend(
    requested: str | None, device: torch.device, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> ResolvedBackends:
    """The concrete implementations for a model computing in `query_dtype` over caches of
    `cache_dtype` on `device`. requested: a Backend name as the user gave it, or None for by
    device (default_backend); ValueError for another name, or "triton" where it cannot run."""
    if requested is not None and requested not in BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {BACKENDS} (or None: by device), got {requested!r}"
        )
    backend = default_backend(device, cache_dtype) if requested is None else requested
    if backend == "triton":
        require_triton(device, cache_dtype, "--attention-backend triton")
        if is_rounded_cache(cache_dtype, query_dtype):
            raise ValueError(
                "kv_cache_dtype bfloat16 with a float32 model runs on the CPU kernels only; on a GPU use "
                "--dtype bfloat16 (its cache is bf16 with kv_cache_dtype auto)"
            )
        return ResolvedBackends(attention="triton", cache="triton", cache_write="triton")
    attention = _torch_attention(device, query_dtype, cache_dtype)
    # The C++ kernels are built when attention uses them; an fp32 or bf16 cache is then
    # written by their copy too.
    cpp_write = attention == "cpp" and cache_dtype in (torch.float32, torch.bfloat16)
    return ResolvedBackends(attention=attention, cache="torch", cache_write="cpp" if cpp_write else "torch")


def attention_impl_for(
    impl: AttentionImpl | None, device: torch.device, query_dtype: torch.dtype, cache_dtype: torch.dtype
) -> AttentionImpl:
    """A paged_attention call's `impl`, checked; None resolves by device (not the engine's path)."""
    if impl is None:
        return resolve_backend(None, device, query_dtype, cache_dtype).attention
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS} or None (by device), got {impl!r}")
    if impl == "triton":
        require_triton(device, cache_dtype, "impl='triton'")
    return impl


def cache_impl_for(
    impl: Backend | None, device: torch.device, cache_dtype: torch.dtype | None = None
) -> Backend:
    """A cache op call's `impl`, checked; None resolves by device (not the engine's path)."""
    if impl is None:
        return default_backend(device, cache_dtype)
    if impl not in BACKENDS:
        raise ValueError(f"impl must be one of {BACKENDS} or None (by device), got {impl!r}")
    if impl == "triton":
        require_triton(device, cache_dtype, "impl='triton'")
    return impl
