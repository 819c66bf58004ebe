"""Helpers shared by the benchmarks: building the engine, phase timing and the contention warning."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.models import DEFAULT_MODEL


def default_model() -> str:
    return DEFAULT_MODEL


# Engine settings a benchmark may take as they are (declared from pagedserve.dataplane.config with
# settings.add_arguments(..., only=KERNEL_SETTINGS)): the kernels and the dtypes they read.
KERNEL_SETTINGS = frozenset({"cpu_linear", "cpu_weight_dtype", "kv_cache_dtype"})
# The quantized paths, for the benchmarks that take them (optional values: not passed on as
# flags to a server the way KERNEL_SETTINGS are).
QUANT_SETTINGS = frozenset({"quantization", "quantized_matmul"})


def engine_from_args(args: Any, model: str, enable_prefix_caching: bool) -> Any:
    """A fp32 `LLM` with the engine flags every model-driven benchmark takes (block size, limits,
    KV pool bytes, threads; the KERNEL_SETTINGS and QUANT_SETTINGS the benchmark has, else the
    engine's defaults)."""
    from pagedserve.dataplane import LLM

    names = sorted(KERNEL_SETTINGS | QUANT_SETTINGS)
    kernel_flags = {name: getattr(args, name) for name in names if hasattr(args, name)}

    return LLM(
        model,
        dtype="float32",
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=enable_prefix_caching,
        num_threads=args.threads,
        **kernel_flags,
    )


def cpu_line() -> str:
    """One line naming the CPU, the flags that matter and the kernel build in use."""
    from pagedserve.benchmarks.isa_cap import active_cap
    from pagedserve.kernels.cpu_isa import cpu_report

    cpu = cpu_report()
    cap = active_cap()
    return (
        f"cpu: {cpu['model']} (family {cpu['family']} model {cpu['model_number']}); flags "
        f"{' '.join(cpu['flags']) or 'none of note'}; kernels {cpu['kernel_isa']} "
        f"(native {cpu['native_isa']})"
        + (f"; every engine capped at {cap} (--cap-isa: oneDNN, torch, vLLM too)" if cap else "")
    )


def kernel_selection(engine: Any) -> list[dict[str, Any]]:
    """The engine's linear-kernel choice per shape (dataplane/src/pagedserve/dataplane/runner/linear_selection.py)."""
    from dataclasses import asdict

    runner = getattr(engine, "runner", None)
    choices = getattr(runner, "linear_choices", {}) or {}
    return [{**asdict(c), "onednn_over_panel": c.speedup} for c in choices.values()]


def selection_table(selection: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Rows of the kernel-selection table: both times per row count, and the choice."""
    from pagedserve.dataplane.runner.linear_selection import ROW_BANDS

    header = ["shape (in x out)", *(f"{r} rows panel / oneDNN ms" for r in ROW_BANDS), "chosen"]
    rows = []
    for c in selection:
        times = [f"{p:.3f} / {o:.3f}" for p, o in zip(c["panel_ms"], c["onednn_ms"], strict=True)] or [
            "-"
        ] * len(ROW_BANDS)
        rows.append([f"{c['in_features']} x {c['out_features']}", *times, f"{c['choice']} ({c['reason']})"])
    return header, rows


def load_note() -> tuple[float, ...]:
    """The 1/5/15-minute load averages (empty where the OS has none)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return ()


def warn_if_busy(loads: tuple[float, ...]) -> None:
    if loads and loads[0] > 0.5:
        print(
            f"warning: load average {loads}: other processes are busy; on 2 cores torch timings "
            "may be 10-100x off (another process's threaded matmuls and ours contend for the cores)",
            file=sys.stderr,
        )


def phase(name: str, fn: Callable[[], Any], doing: str = "") -> Any:
    """Run one benchmark phase, printing its start (with `doing`: what it does and about how
    long, for a phase whose progress bar starts late or moves rarely) and duration on stderr."""
    print(
        f"[{time.strftime('%H:%M:%S')}] {name}{': ' + doing if doing else ''} ...",
        file=sys.stderr,
        flush=True,
    )
    t = time.perf_counter()
    out = fn()
    print(
        f"[{time.strftime('%H:%M:%S')}] {name} done in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return out
