"""release_openmp_threads ends the calling thread's libgomp worker threads (dataplane/src/pagedserve/dataplane/server/openmp.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pagedserve.dataplane.server.openmp import loaded_libgomp, release_openmp_threads


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _still_running(workers: set[str]) -> set[str]:
    """The workers whose ids are still listed. libgomp releases its workers and returns; each
    worker then leaves its dock and exits on its own, so on a loaded machine a released worker
    can still be listed for a moment (CI once saw one). Wait for that exit, bounded, rather
    than reading the list once: a worker that never exits still fails the test."""
    deadline = time.monotonic() + 10.0
    left = workers & _thread_ids()
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = workers & _thread_ids()
    return left


@pytest.fixture(autouse=True)
def _needs_libgomp() -> None:
    if loaded_libgomp() is None:
        pytest.skip("this torch build does not use libgomp")


def test_the_loaded_libgomp_is_found() -> None:
    path = loaded_libgomp()
    assert path is not None and path.name.startswith("libgomp.so") and path.exists()


def test_release_ends_this_threads_workers_and_a_new_region_starts_them_again() -> None:
    """In a fresh thread (its own OpenMP pool): a 3-thread region starts 2 workers, the release
    ends those two, and the next parallel op starts them again and still computes right."""
    seen: dict[str, object] = {}

    # Thread ids, not counts: another test's thread may start or end meanwhile (a count once
    # saw one more thread after the release); the workers are the ids the region added.
    def body() -> None:
        torch.set_num_threads(3)
        a = torch.randn(256, 256)
        before = _thread_ids()
        expected = a @ a  # a parallel region: this thread's pool gets its 2 workers
        workers = _thread_ids() - before
        seen["with_pool"] = len(workers)
        seen["released"] = release_openmp_threads()
        seen["after_release"] = len(_still_running(workers))
        after = _thread_ids()
        seen["same_result"] = torch.equal(a @ a, expected)
        seen["restarted"] = len(_thread_ids() - after)

    previous = torch.get_num_threads()
    try:
        worker = threading.Thread(target=body)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    assert seen == {
        "with_pool": 2,
        "released": True,
        "after_release": 0,
        "same_result": True,
        "restarted": 2,
    }
