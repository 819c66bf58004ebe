"""Loaded at start-up by every Python process of a `pagedserve bench ... --cap-isa avx2` run
(benchmarks/src/pagedserve/benchmarks/isa_cap.py puts this folder on PYTHONPATH), the peers' own interpreters and the
processes they spawn included: torch.cpu then reports no AVX-512, AVX-512 BF16/VNNI or AMX,
so vLLM's CPU build loads its AVX2 kernels (`_C_AVX2`) and takes its AVX2 paths, as it would
on an AVX2-only CPU. Does nothing unless the run set ATEN_CPU_CAPABILITY=avx2, and nothing
in an interpreter without torch."""

import os

if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    try:
        import torch.cpu
    except ImportError:
        pass
    else:
        for _name in (
            "_is_avx512_supported",
            "_is_avx512_vnni_supported",
            "_is_avx512_bf16_supported",
            "_is_amx_tile_supported",
            "_is_amx_fp16_supported",
        ):
            if hasattr(torch.cpu, _name):
                setattr(torch.cpu, _name, lambda: False)
