"""Release the calling thread's OpenMP worker threads, once the model is loaded.

Why: the data plane loads the model (and warms it up) in its main thread, then steps the
engine in its engine-loop thread. libgomp, torch's OpenMP runtime, keeps a pool of worker
threads for every thread that ever entered a parallel region, and once the pools together
hold more threads than there are CPUs it stops spinning between parallel regions (its
throttled spin count): every fork/join of every op then waits on a futex wake-up. Measured
on the default model, 2 cores, a 16-row decode step: 52 ms when stepped in the loading
thread, 70 ms in a second thread, 44 ms in the second thread once the loading thread's pool
was released. `omp_pause_resource_all(omp_pause_hard)` (OpenMP 5.0) ends the calling
thread's pool; a later parallel region in that thread would start a new one, so the main
thread must not run torch ops afterwards (it only serves gRPC).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# OpenMP 5.0's omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2.
_OMP_PAUSE_HARD = 2


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
