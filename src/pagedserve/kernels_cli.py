"""`pagedserve kernels build`: build (or find already built) the C++ CPU kernels ahead of the
first start, so that `serve` never compiles in silence; `make serve` runs it once.

The build is the one a start would do (kernels/src/pagedserve/kernels/cpu_ext.py: one folder per content digest under
$TORCH_EXTENSIONS_DIR/pagedserve, shared by every checkout, guarded by a lock the OS drops when
its owner dies), so a later start only loads the library.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _cmd_build(args: argparse.Namespace) -> int:
    from pagedserve.kernels.cpu_ext import load_cpu_kernels
    from pagedserve.kernels.cpu_isa import cpu_report, runnable_isas, selected_isa

    report = cpu_report()
    isas = list(runnable_isas()) if args.isa == "all" else [selected_isa() if args.isa is None else args.isa]
    print(f"pagedserve kernels: CPU {report['model']} ({' '.join(report['flags']) or 'no SIMD flags'})")
    failed = 0
    for isa in isas:
        started = time.perf_counter()
        try:
            kernels = load_cpu_kernels(strict=True, verbose=args.verbose, isa=isa)
        except (RuntimeError, ValueError) as exc:
            print(f"pagedserve kernels: {isa}: error: {exc}", file=sys.stderr)
            failed += 1
            continue
        assert kernels is not None  # strict=True raises instead
        print(
            f"pagedserve kernels: {isa} ready in {time.perf_counter() - started:.1f} s: {kernels.library_path}"
        )
    return 1 if failed else 0


def add_kernels_parser(subparsers: Any) -> None:
    """Add the `kernels` command (subcommand `build`) to an argparse subparsers object."""
    kernels = subparsers.add_parser(
        "kernels", help="the C++ CPU kernels: build them ahead of the first start"
    )
    ksub = kernels.add_subparsers(dest="kernels_command", required=True)
    build = ksub.add_parser("build", help="build (once per CPU and source version) and load the CPU kernels")
    build.add_argument(
        "--isa",
        choices=["all", "avx512", "avx2", "portable"],
        default=None,
        help="which build: one ISA level, or all this CPU runs (default: $PAGEDSERVE_CPU_ISA, else the "
        "best level this CPU runs)",
    )
    build.add_argument("--verbose", action="store_true", help="show the compiler's command lines and output")
    build.set_defaults(func=_cmd_build)
