"""Which instruction-set level this CPU runs, and which one the C++ kernels are built for.

One build per level (`CPU_ISAS`): avx512 (AVX-512 F/BW/DQ/VL), avx2 (AVX2 + FMA + F16C,
x86-64-v3) and portable (the architecture's baseline: SSE2 on x86-64, NEON on aarch64). By
default the process uses the best level this CPU runs; `PAGEDSERVE_CPU_ISA=avx512|avx2|portable`
picks a lower one, so an AVX-512 machine builds and tests the kernels an older CPU would run.
Read from /proc/cpuinfo; imports no torch, so `doctor` and reports can ask without loading it.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

# The instruction-set levels a build can target, best first, and the environment variable
# that picks one (unset or "auto": the best this CPU runs).
CPU_ISAS = ("avx512", "avx2", "portable")
ISA_ENV = "PAGEDSERVE_CPU_ISA"
# The CPU flags each x86 level needs (/proc/cpuinfo spelling).
_X86_LEVEL_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}
# The flags that matter for the kernels and for bf16, as benchmarks and `doctor` report them.
REPORTED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


def _cpuinfo_first_processor() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (they describe them all); {} elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass  # not Linux: the machine and processor strings are what there is
    return fields


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (x86 `flags`, ARM `Features`), lower case."""
    info = _cpuinfo_first_processor()
    return frozenset((info.get("flags") or info.get("Features") or "").lower().split())


def cpu_model() -> str:
    info = _cpuinfo_first_processor()
    return info.get("model name") or platform.processor() or platform.machine()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def isa_for_flags(flags: frozenset[str], x86: bool = True) -> str:
    """The best of CPU_ISAS a CPU with these flags executes (portable off x86: NEON is
    aarch64's baseline, and the portable build targets it)."""
    if x86:
        for isa in ("avx512", "avx2"):
            if _X86_LEVEL_FLAGS[isa] <= flags:
                return isa
    return "portable"


@functools.cache
def native_isa() -> str:
    """The best of CPU_ISAS this CPU executes."""
    return isa_for_flags(cpu_flags(), _is_x86())


def runnable_isas() -> tuple[str, ...]:
    """The levels this CPU executes, best first: the native one and every one below it."""
    return CPU_ISAS[CPU_ISAS.index(native_isa()) :]


@functools.cache
def check_isa(isa: str) -> str:
    """isa if this CPU can run a build for it, else ValueError naming what is missing."""
    if isa not in CPU_ISAS:
        raise ValueError(f"{ISA_ENV}: unknown instruction set {isa!r}; choose auto, {', '.join(CPU_ISAS)}")
    if isa not in runnable_isas():
        missing = sorted(_X86_LEVEL_FLAGS.get(isa, frozenset()) - cpu_flags())
        raise ValueError(
            f"{ISA_ENV}={isa}: this CPU cannot run it (missing {', '.join(missing) or isa}); "
            f"it runs {', '.join(runnable_isas())}"
        )
    return isa


def selected_isa() -> str:
    """$PAGEDSERVE_CPU_ISA when set (and not "auto"), else the best level this CPU runs.

    Read on every call (a dict lookup; the checks are cached), so a test can switch a whole
    process's kernels by setting the variable.
    """
    requested = os.environ.get(ISA_ENV, "")
    if requested in ("", "auto"):
        return native_isa()
    return check_isa(requested.strip().lower())


def cpu_report() -> dict[str, Any]:
    """What benchmarks and `doctor` record about the CPU the kernels run on."""
    flags = cpu_flags()
    info = _cpuinfo_first_processor()
    return {
        "model": cpu_model(),
        "family": info.get("cpu family", ""),
        "model_number": info.get("model", ""),
        "machine": platform.machine(),
        "flags": [flag for flag in REPORTED_FLAGS if flag in flags],
        "native_isa": native_isa(),
        "kernel_isa": selected_isa(),
    }


def cpu_fingerprint() -> str:
    """What distinguishes this CPU for -march=native: its model and feature flags."""
    info = _cpuinfo_first_processor()
    parts = [platform.machine(), platform.processor()]
    parts += [
        f"{key}: {info[key]}"
        for key in ("model name", "flags", "Features", "CPU part", "CPU implementer")
        if key in info
    ]
    return "\n".join(parts)
