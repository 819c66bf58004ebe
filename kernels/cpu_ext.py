"""C++ CPU kernels (kernels/cpu/*.cpp), JIT-built with torch.utils.cpp_extension on first use.

Nothing is built at import: the first load_cpu_kernels() call compiles the extension (about
3-4 s cold on 2 cores, see benchmarks/paged_attention_cpu.py --cold-build) into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR as torch reads it), where later
processes find it and only relink-check it; within a process the result is memoised. If
the build fails (no C++ compiler, no ninja) a single warning is logged and callers fall back
to the torch implementations.

The build uses -march=native: it runs on the machine that will use it, so the kernel gets
whatever vector width that CPU has (AVX-512, AVX2, NEON, ...) and never an instruction it
lacks. The extension's name carries a fingerprint of the CPU, so a cache directory shared
between different machines (an NFS home) never hands one CPU's build to another. A
compiler that rejects -march=native gets a second, portable build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CPU_DIR = Path(__file__).parent / "cpu"
_SOURCES = tuple(
    _CPU_DIR / name
    for name in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "layer_ops.cpp",
        "cache_ops.cpp",
        "linear.cpp",
        "decoder_block.cpp",
    )
)
# Included by the sources. torch's JIT build hashes only the sources into its version, so
# the headers' contents go into the extension's name instead: a changed header is a new build.
_HEADERS = tuple(_CPU_DIR / name for name in ("vec.h", "attention_checks.h", "panel.h", "row_ops.h"))
# The TORCH_LIBRARY namespace the sources register their ops under.
_OP_NAMESPACE = "pagedserve_cpu"


@dataclass(frozen=True)
class CpuKernels:
    """The loaded extension's ops (their contracts: the comments atop kernels/cpu/*.cpp)."""

    # paged_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
    #                        token_rows, scale, v_scale=1.0) -> None, writes out in place;
    # caches float32 or FP8 (float8_e4m3fn / float8_e5m2; scale then includes k_scale)
    paged_decode_attention: Callable[..., None]
    # kernels/cpu/prefill_attention.cpp: paged_prefill_attention(out, query, key_cache,
    #     value_cache, block_tables, seq_lens, query_starts, query_lens, scale) -> None, causal
    #     attention of the prefill rows, written in place; float32 query and caches only
    paged_prefill_attention: Callable[..., None]
    # kernels/cpu/layer_ops.cpp, all float32, all write in place and return None:
    # rms_norm(out, x, weight, eps); add_rms_norm(out, residual, delta, weight, eps) (also
    # residual += delta); silu_and_mul(out, gate_up); rotary_neox(qk, cos, sin) (qk in place)
    rms_norm: Callable[..., None]
    add_rms_norm: Callable[..., None]
    silu_and_mul: Callable[..., None]
    rotary_neox: Callable[..., None]
    # kernels/cpu/cache_ops.cpp: write_kv_cache(key_cache, value_cache, key, value,
    # slot_mapping), float32 caches, in place
    write_kv_cache: Callable[..., None]
    # kernels/cpu/linear.cpp: panel_linear(out, x, packed, bias), float32, out written; packed
    # by kernels.linear.pack_panels, bias empty for none
    panel_linear: Callable[..., None]
    # kernels/cpu/decoder_block.cpp, float32, a decoder layer's halves around attention:
    # decoder_attention_input(hidden, norm_weight, eps, qkv_packed, qkv_bias, qkv_features, cos,
    #     sin, rotary_heads) -> qkv (normed, projected, q/k rotated);
    # decoder_mlp(hidden, attn, o_packed, o_bias, norm_weight, eps, gate_up_packed, gate_up_bias,
    #     intermediate_size, down_packed, down_bias) -> None (o_proj, residual, norm, MLP,
    #     residual: hidden in place)
    decoder_attention_input: Callable[..., torch.Tensor]
    decoder_mlp: Callable[..., None]
    library_path: str
    cflags: tuple[str, ...]


_lock = threading.Lock()
# Unset until the first load; then the kernels, or the exception the build failed with.
_loaded: list[CpuKernels | BaseException] = []


def load_cpu_kernels(*, strict: bool = False, verbose: bool = False) -> CpuKernels | None:
    """Build (first call, or after a source change) and load the C++ CPU kernels.

    Returns None when they cannot be built (one warning is logged for the process), or
    raises RuntimeError instead with strict=True (for tests, where a missing kernel is a
    failure). verbose shows the compiler's command lines and output.
    """
    # Fast path, no lock: the engine asks on every layer call once the build is done.
    result = _loaded[0] if _loaded else None
    if result is None:
        result = _load_once(verbose)
    if isinstance(result, BaseException):
        if strict:
            raise RuntimeError(f"the C++ CPU kernels could not be built: {result}") from result
        return None
    return result


def _load_once(verbose: bool) -> CpuKernels | BaseException:
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_build(verbose))
            except Exception as exc:  # any build or load failure means: use the torch path
                logger.warning(
                    "pagedserve: the C++ CPU kernels could not be built, using the slower torch "
                    "attention path (needs a C++ compiler and ninja: pip install ninja): %s",
                    _summarise(exc),
                )
                _loaded.append(exc)
        return _loaded[0]


def _summarise(exc: BaseException, max_lines: int = 15) -> str:
    lines = str(exc).strip().splitlines()
    if len(lines) <= max_lines:
        return " | ".join(lines)
    return " | ".join(["...", *lines[-max_lines:]])


def _cpu_fingerprint() -> str:
    """What distinguishes this CPU for -march=native: its model and feature flags."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part", "CPU implementer"):
                    parts.append(line.strip())
                elif not line.strip() and len(parts) > 2:
                    break  # the first processor describes them all
    except OSError:
        pass  # not Linux: the machine and processor strings are what there is
    return "\n".join(parts)


def _path_with_ninja() -> str:
    """PATH, plus the pip ninja's directory when no ninja is on it.

    torch runs `ninja` by name; a venv's ninja is not on PATH when the venv's python is run
    without activating the venv (as CI and `make` do).
    """
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is not None:
        return path
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return path
    return os.pathsep.join([bin_dir, path]) if path else bin_dir


def _build(verbose: bool) -> CpuKernels:
    from torch.utils import cpp_extension

    # The source uses only torch's stable ABI; parallelism comes from libtorch's own
    # parallel_for, so no OpenMP flags (see kernels/cpu/paged_attention.cpp).
    attempts = [["-O3", "-march=native"], ["-O3"]]
    digest = hashlib.sha256(_cpu_fingerprint().encode())
    for header in _HEADERS:
        digest.update(header.read_bytes())
    fingerprint = digest.hexdigest()[:12]
    old_path = os.environ.get("PATH")
    errors: list[str] = []
    # torch's build reads PATH when it runs; restored below.
    os.environ["PATH"] = _path_with_ninja()
    try:
        for i, cflags in enumerate(attempts):
            name = f"pagedserve_cpu_{fingerprint}" + ("" if i == 0 else "_portable")
            try:
                library = cpp_extension.load(
                    name=name,
                    sources=[str(s) for s in _SOURCES],
                    extra_cflags=cflags,
                    is_python_module=False,
                    verbose=verbose,
                )
            except Exception as exc:
                errors.append(f"{' '.join(cflags)}: {exc}")
                # A missing toolchain fails both attempts alike; only a rejected flag warrants
                # the portable retry.
                if "ninja" in str(exc).lower() and "required" in str(exc).lower():
                    break
                continue
            ops = getattr(torch.ops, _OP_NAMESPACE)
            return CpuKernels(
                paged_decode_attention=ops.paged_decode_attention.default,
                paged_prefill_attention=ops.paged_prefill_attention.default,
                rms_norm=ops.rms_norm.default,
                add_rms_norm=ops.add_rms_norm.default,
                silu_and_mul=ops.silu_and_mul.default,
                rotary_neox=ops.rotary_neox.default,
                write_kv_cache=ops.write_kv_cache.default,
                panel_linear=ops.panel_linear.default,
                decoder_attention_input=ops.decoder_attention_input.default,
                decoder_mlp=ops.decoder_mlp.default,
                library_path=str(library),
                cflags=tuple(cflags),
            )
    finally:
        if old_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = old_path
    raise RuntimeError("\n".join(errors))
