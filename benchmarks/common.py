"""Helpers shared by the benchmark scripts: phase timing and the contention warning."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from dataplane.config import DEFAULT_MODEL


def default_model() -> str:
    return DEFAULT_MODEL


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
            "may be 10-100x off (PEERS.md 'Contention')",
            file=sys.stderr,
        )


def phase(name: str, fn: Callable[[], Any]) -> Any:
    """Run one benchmark phase, printing its start and duration on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    out = fn()
    print(
        f"[{time.strftime('%H:%M:%S')}] {name} done in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return out
