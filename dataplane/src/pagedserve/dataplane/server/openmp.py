"""The data plane's OpenMP threads: how long idle ones spin, and releasing the loading
thread's pool once the model is loaded.

Spinning: between parallel regions (a step runs hundreds) libgomp's idle threads spin
GOMP_SPINCOUNT times before they sleep, 300,000 by default. When another process wants one of
the engine's cores (the control plane under `serve`, a sidecar, a pod without pinned CPUs),
each region then waits for the thread that shares its core to get a time slice while the
others spin on theirs: a step stalls for most of the time the other process runs. A low count
ends those stalls for a little throughput when nothing else runs (benchmarks/README.md, the
`busy` case). libgomp reads the variable once, when it is loaded, so `set_spin_count`
must run before torch is imported.

Releasing: the data plane loads the model (and warms it up) in its main thread, then steps the
engine in its engine-loop thread. libgomp, torch's OpenMP runtime, keeps a pool of worker
threads for every thread that ever entered a parallel region, and once the pools together
hold more threads than there are CPUs it stops spinning between parallel regions (its
throttled spin count): every fork/join of every op then waits on a futex wake-up, and a step
in the engine-loop thread runs slower than in the loading thread until the loading thread's
pool is released. `omp_pause_resource_all(omp_pause_hard)` (OpenMP 5.0) ends the calling
thread's pool; a later parallel region in that thread would start a new one, so the main
thread must not run torch ops afterwards (it only serves gRPC).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# OpenMP 5.0's omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2.
_OMP_PAUSE_HARD = 2


SPIN_COUNT_VARIABLE = "GOMP_SPINCOUNT"


def set_spin_count(spins: int) -> str | None:
    """Have this process's libgomp spin `spins` times before an idle thread sleeps, unless the
    environment already says (then it wins). The value in effect, or None where libgomp is
    already loaded without one (too late: it keeps its default; a warning says so)."""
    given = os.environ.get(SPIN_COUNT_VARIABLE)
    if given is not None:
        return given
    if loaded_libgomp() is not None:
        log.warning("libgomp is already loaded: %s=%d not applied", SPIN_COUNT_VARIABLE, spins)
        return None
    os.environ[SPIN_COUNT_VARIABLE] = str(spins)
    return str(spins)


def loaded_libgomp() -> Path | None:
    """The libgomp this process has loaded (torch's bundled copy or the system's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no libgomp to release
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp.so"):
            return Path(fields[5])
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker threads; False where there is no libgomp (another
    OpenMP runtime, or none loaded) or it refused (it returns non-zero inside a parallel region)."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(str(path))  # already loaded: the same handle, nothing new is mapped
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp before OpenMP 5.0 (GCC < 9)
        log.debug("libgomp at %s has no omp_pause_resource_all", path)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return bool(pause(_OMP_PAUSE_HARD) == 0)
