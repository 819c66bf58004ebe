"""`pagedserve bench ... --cap-isa avx2`: every engine of the run limited to AVX2 + FMA, so that
an AVX-512 machine measures what an AVX2-only one (Zen 2/3, Haswell to Skylake client parts)
would, peers included. The run re-executes itself once with:

- PAGEDSERVE_CPU_ISA=avx2: our C++ kernels' AVX2 build (kernels/src/pagedserve/kernels/cpu_ext.py);
- ONEDNN_MAX_CPU_ISA=AVX2: oneDNN's linears and convolutions, for us, transformers and vLLM;
- ATEN_CPU_CAPABILITY=avx2: torch's own vectorized kernels;
- PYTHONPATH with isa_cap_site/, whose sitecustomize makes torch.cpu report no AVX-512 or AMX
  in every Python process of the run (vLLM then loads its `_C_AVX2` kernels).

What it does not cap: code that reads cpuid itself (llama.cpp's ggml, OpenBLAS, the compiler's
own -march=native builds), and the memory system, which stays the AVX-512 part's. Reports say
"capped at avx2"; a real AVX2-only machine remains the reference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CAPS = ("avx2",)
SITE_DIR = Path(__file__).resolve().parent / "isa_cap_site"
_MARK = "PAGEDSERVE_BENCH_ISA_CAP"  # set in the re-executed run


def cap_env(isa: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with every engine of the run capped at `isa`."""
    if isa not in CAPS:
        raise ValueError(f"--cap-isa must be one of {', '.join(CAPS)}, got {isa!r}")
    capped = dict(env)
    capped.update(
        {
            "PAGEDSERVE_CPU_ISA": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2",
            _MARK: isa,
        }
    )
    path = [str(SITE_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    capped["PYTHONPATH"] = os.pathsep.join(path)
    return capped


def active_cap() -> str | None:
    """The ISA this run is capped at, or None."""
    return os.environ.get(_MARK) or None


def reexec_capped(isa: str) -> None:
    """Replace this process by the same command under `cap_env(isa)`; a no-op once capped
    (the caps must be in the environment before torch and oneDNN first read them)."""
    if active_cap() == isa:
        return
    env = cap_env(isa, dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
