"""The tensor-parallel process group: gloo over a TCP store that rank 0 hosts.

No global state: each engine gets its own `ProcessGroupGloo` (not torch.distributed's default
group), so several engines can live in one process (tests) and nothing needs tearing down
but the object. Every collective has the group's timeout: a peer that stops answering fails
the step with an error instead of hanging it (a peer that dies closes its sockets, which
fails the collective at once).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

# The c10d classes themselves: torch.distributed re-exports them untyped.
from torch._C._distributed_c10d import ProcessGroupGloo, Store, TCPStore

# Long enough for the slowest step of a loaded CPU (a long prefill on shared cores), short
# enough that a stuck peer ends the data plane in minutes rather than never.
COLLECTIVE_TIMEOUT_S = 300.0
STORE_HOST = "127.0.0.1"


class TensorParallelGroup:
    """One rank's view of the group: its rank, the size, and the collectives the model and
    the step plan use. Counts the seconds spent in collectives (the communication share)."""

    def __init__(self, store: Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        # Blocks until every rank has joined (bounded by the timeout).
        self._pg = ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
        self.comm_seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place (every rank ends with the same bits: two
        addends commute exactly, and gloo gives every rank the one reduced buffer)."""
        start = time.perf_counter()
        self._pg.allreduce([tensor]).wait()  # type: ignore[attr-defined]  # (stubs lack it)
        self.comm_seconds += time.perf_counter() - start

    def barrier(self) -> None:
        """Wait for every rank (an all-reduce of one zero, not counted as step communication)."""
        self._pg.allreduce([torch.zeros(1)]).wait()  # type: ignore[attr-defined]  # (stubs lack it)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype), in place."""
        start = time.perf_counter()
        self._pg.broadcast(tensor, 0).wait()  # type: ignore[attr-defined]  # (stubs lack it)
        self.comm_seconds += time.perf_counter() - start


def host_store(world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`); returns at once."""
    return TCPStore(
        STORE_HOST,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_store(port: int, world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TCPStore:
    """A worker's connection to rank 0's store."""
    return TCPStore(STORE_HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def threads_per_rank(num_threads: int | None, world_size: int) -> int:
    """Intra-op threads of each rank: `num_threads` when set (per rank), else this process's
    torch default split evenly, so that N ranks share the cores instead of each taking all
    of them (oversubscribed ranks stall each other at every all-reduce)."""
    if num_threads:
        return num_threads
    return max(1, torch.get_num_threads() // world_size)
