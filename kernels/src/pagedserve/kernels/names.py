"""The kernel backends a user can choose, by name: the one vocabulary of `--attention-backend`.

A leaf without torch: pagedserve.dataplane.config validates its setting against BACKENDS and must stay
importable without torch (the control plane and the scheduler tests import it), so the names
live here rather than in pagedserve.kernels.backend, which resolves them against a device.
"""

from typing import Literal, get_args

# "torch": the torch reference path (and on the CPU the C++ decode kernel for fp32);
# "triton": the Triton kernels. No choice (None) means by device: pagedserve.kernels.backend.
Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# `--kv-cache-dtype` (vLLM's names): "auto" stores K/V in the model's dtype; "bfloat16" rounds
# an fp32 model's K/V to bf16 (half the bytes; the CPU kernels widen them back exactly);
# the FP8 formats keep 1 byte per element with per-layer scales (pagedserve.kernels.fp8).
KVCacheDtype = Literal["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = get_args(KVCacheDtype)
