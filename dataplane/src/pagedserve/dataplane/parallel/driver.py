"""Rank 0's side of tensor parallelism: start the workers, hand them each step's plan, and
take the data plane down when one dies.

Workers are `python -m pagedserve.dataplane.parallel.worker` processes that die with this one
(PR_SET_PDEATHSIG). Each reads an 8-byte plan length from its stdin pipe, then takes the plan
itself in one broadcast: so an idle worker waits on a pipe (no collective timeout to outlive),
and a closed pipe is its signal to exit. A watcher thread per worker notices an exit that
`shutdown` did not ask for: it logs one error line and, by default, ends this process with
exit status 1 (the data plane's supervisor restarts it; its control planes see the link drop).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagedserve.common import settings
from pagedserve.common.lifecycle import EXIT_ERROR, print_error
from pagedserve.common.log import get_logger
from pagedserve.dataplane.config import EngineConfig
from pagedserve.dataplane.parallel import step_plan
from pagedserve.dataplane.parallel.group import COLLECTIVE_TIMEOUT_S, TensorParallelGroup, host_store
from pagedserve.dataplane.runner.kv_scales import KVScales
from pagedserve.dataplane.runner.model_runner import StepInputs

log = get_logger(__name__)

LAYOUT_KEY = "pagedserve/layout"
PLAN_LENGTH_BYTES = 8
_SHUTDOWN_WAIT_S = 10.0


@dataclass(frozen=True)
class WorkerLayout:
    """What rank 0 decided that every worker must mirror: the pools' block counts (block ids
    are the same on every rank) and an FP8 cache's scales (calibrated once, on rank 0)."""

    num_blocks: int
    num_host_blocks: int
    k_scale: tuple[float, ...] | None = None
    v_scale: tuple[float, ...] | None = None
    scales_source: str = ""

    def kv_scales(self) -> KVScales | None:
        if self.k_scale is None or self.v_scale is None:
            return None
        return KVScales(tuple(self.k_scale), tuple(self.v_scale), self.scales_source)

    @classmethod
    def of(cls, num_blocks: int, num_host_blocks: int, scales: KVScales | None) -> WorkerLayout:
        if scales is None:
            return cls(num_blocks, num_host_blocks)
        return cls(num_blocks, num_host_blocks, scales.k_scale, scales.v_scale, scales.source)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerLayout:
        data = json.loads(text)
        for key in ("k_scale", "v_scale"):
            if data[key] is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def kv_pool_key(rank: int) -> str:
    """The store key under which a worker publishes its KV pool's shape (JSON list)."""
    return f"pagedserve/kv_pool/{rank}"


def _exit_data_plane(rank: int, exit_code: int) -> None:
    print_error(f"tensor-parallel worker rank {rank} died (exit code {exit_code}); the data plane exits")
    os._exit(EXIT_ERROR)


class TensorParallelDriver:
    """Starts ranks 1..N-1 for `config` at once; `connect` then joins the group with them."""

    def __init__(
        self,
        config: EngineConfig,
        on_worker_death: Callable[[int, int], None] = _exit_data_plane,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.timeout_s = timeout_s
        self.group: TensorParallelGroup | None = None
        self.num_plans = 0
        self._on_worker_death = on_worker_death
        self._closing = threading.Event()
        self._store = host_store(self.world_size, timeout_s)
        config_json = settings.to_json(config)
        self.workers: list[subprocess.Popen[bytes]] = []
        for rank in range(1, self.world_size):
            argv = [
                sys.executable,
                "-m",
                "pagedserve.dataplane.parallel.worker",
                f"--rank={rank}",
                f"--world-size={self.world_size}",
                f"--store-port={self._store.port}",
                f"--parent-pid={os.getpid()}",
                f"--timeout-s={timeout_s}",
                f"--config-json={config_json}",
            ]
            self.workers.append(subprocess.Popen(argv, stdin=subprocess.PIPE))
        for rank, proc in enumerate(self.workers, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True
            ).start()

    def connect(self, layout: WorkerLayout) -> TensorParallelGroup:
        """Publish rank 0's `layout`, join the group and wait until every worker has built its
        runner (or the timeout)."""
        self._store.set(LAYOUT_KEY, layout.to_json())
        self.group = TensorParallelGroup(self._store, 0, self.world_size, self.timeout_s)
        self.group.barrier()
        log.info("tensor_parallel_ready", world_size=self.world_size, workers=[p.pid for p in self.workers])
        return self.group

    def worker_kv_pool_shape(self, rank: int) -> tuple[int, ...]:
        """A worker's KV pool shape per layer and K/V: [blocks, block_size, its KV heads, head_dim]."""
        return tuple(json.loads(self._store.get(kv_pool_key(rank))))

    def send(self, inputs: StepInputs) -> None:
        """Hand one forward's inputs to every worker (the runner's step listener)."""
        if self.group is None:
            raise RuntimeError("TensorParallelDriver.send before connect")
        plan = step_plan.pack(inputs)
        header = plan.numel().to_bytes(PLAN_LENGTH_BYTES, "little")
        for rank, proc in enumerate(self.workers, start=1):
            assert proc.stdin is not None
            try:
                proc.stdin.write(header)
                proc.stdin.flush()
            except BrokenPipeError:
                raise RuntimeError(f"tensor-parallel worker rank {rank} is gone") from None
        self.group.broadcast(plan)
        self.num_plans += 1

    def shutdown(self) -> None:
        """End the workers (their stdin closes: they exit), killing any that linger. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        for proc in self.workers:
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(BrokenPipeError):  # a dead worker's pipe
                    proc.stdin.close()
            if self.group is None and proc.poll() is None:
                proc.terminate()  # still starting up (it reads stdin only once it serves plans)
        for proc in self.workers:
            try:
                proc.wait(_SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        exit_code = proc.wait()
        if self._closing.is_set():
            return
        log.error(
            "tensor_parallel_worker_died",
            rank=rank,
            pid=proc.pid,
            exit_code=exit_code,
            message=f"tensor-parallel worker rank {rank} exited with {exit_code}; the data plane cannot step",
        )
        self._on_worker_death(rank, exit_code)
