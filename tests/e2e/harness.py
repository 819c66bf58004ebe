"""Real servers on ephemeral ports for the gRPC end-to-end tests.

Data planes run in-process (their engine loop in its own thread, as in production) or as
subprocesses when a test must kill one; control planes likewise.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pagedserve.common.tls import ServerTLS
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.server import ControlPlane, start_control_plane
from pagedserve.dataplane.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.dataplane.server.engine_loop import EngineLoop
from pagedserve.dataplane.server.server import build_engine_loop, create_server
from pagedserve.protos.pagedserve.v1 import dataplane_pb2, dataplane_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def engine_config(
    model: str | Path,
    num_blocks: int | None = 64,
    max_model_len: int | None = 1024,
    max_num_seqs: int = 16,
    **kw: Any,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model), num_threads=1),
        cache=CacheConfig(num_gpu_blocks_override=num_blocks, enable_prefix_caching=True, **kw),
        scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs),
    )


@dataclass
class DataPlane:
    loop: EngineLoop
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        self.loop.stop()


async def start_dataplane(config: EngineConfig, name: str = "dp", tls: ServerTLS | None = None) -> DataPlane:
    loop = build_engine_loop(config, dataplane_id=name)
    server, port = await create_server(loop, "127.0.0.1:0", tls)
    return DataPlane(loop, server, port)


async def start_controlplane(model: str | Path, addresses: Sequence[str], **kw: Any) -> ControlPlane:
    config = ControlPlaneConfig(model=str(model), dataplanes=tuple(addresses), **kw)
    cp = await start_control_plane(config, "127.0.0.1", 0, http_port=None)
    assert await cp.dispatcher.wait_ready(10.0), "no data plane connected"
    for link in cp.dispatcher.connections.values():
        await link.wait_connected(10.0)
    return cp


async def get_state(address: str) -> dataplane_pb2.GetStateResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await dataplane_pb2_grpc.DataPlaneServiceStub(channel).GetState(
            dataplane_pb2.GetStateRequest(), timeout=5
        )


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it is true; fail naming `what` after `timeout_s`. For tests
    that must wait for something to happen: a fixed sleep is either too short or too long."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.01)


async def wait_until_async(
    predicate: Callable[[], object | Awaitable[object]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """`wait_until` on the event loop; `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(0.01)


class HeldEngine:
    """A data plane's engine loop held between two steps until `release()` (or the hang guard):
    part of a scenario that needs the engine still (a request admitted keeps its reservation,
    nothing streams), decided by an event rather than by a sleep a loaded machine can outlast."""

    def __init__(self, loop: EngineLoop, guard_s: float = 120.0) -> None:
        self._gate = threading.Event()
        self.entered = threading.Event()

        def hold() -> None:
            self.entered.set()
            self._gate.wait(guard_s)

        loop._post(hold)  # the loop runs posted commands in order, between steps

    @property
    def holding(self) -> bool:
        return not self._gate.is_set()

    def release(self) -> None:
        self._gate.set()

    def __enter__(self) -> HeldEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def wait_idle(address: str, timeout_s: float = 10.0) -> dataplane_pb2.GetStateResponse:
    """Poll until the data plane runs nothing and every block is free again (or fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await get_state(address)
        stats = state.snapshot.stats
        if (
            not state.requests
            and stats.free_blocks == stats.total_blocks
            and stats.num_running == stats.num_waiting == 0
        ):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(
                f"data plane not idle after {timeout_s}s: {stats} requests={list(state.requests)}"
            )
        await asyncio.sleep(0.05)


class Process:
    """A `pagedserve` subprocess; `address` is parsed from its "... on HOST:PORT" line."""

    def __init__(self, argv: list[str], marker: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        # stderr (the JSON logs) goes to a file, so that a start-up failure can say why.
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  # lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", *argv],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if marker in line:
                self.line = line
                self.address = line.split(marker, 1)[1].split()[0].strip()
                break
        else:
            code = self.proc.wait()
            self._stderr.seek(0)
            tail = self._stderr.read()[-4000:]
            raise AssertionError(
                f"`pagedserve {' '.join(argv)}` exited with {code} before serving; stderr:\n{tail}"
            )

    def stderr(self) -> str:
        """Everything the process has written to stderr (its JSON log lines) so far."""
        fd = self._stderr.fileno()  # pread: the child writes at the offset it shares with us
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=20)


def dataplane_process(model: Path, num_blocks: int = 64, max_model_len: int = 1024) -> Process:
    argv = ["dataplane", "--port", "0", "--model", str(model), "--threads", "1"]
    argv += ["--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len)]
    return Process(argv, "listening on ")


def controlplane_process(model: Path, dataplanes: Sequence[str]) -> Process:
    argv = ["controlplane", "--model", str(model), "--grpc-port", "0", "--http-port", "0"]
    for address in dataplanes:
        argv += ["--dataplane", address]
    return Process(argv, "gRPC on ")


class ServerThread:
    """A data plane and a control plane (gRPC + HTTP) on an event loop in a background thread,
    so synchronous clients (the official `openai` package) can call them from the test."""

    def __init__(
        self,
        config: EngineConfig,
        model: str | Path,
        dp_server_tls: ServerTLS | None = None,
        **cp_kwargs: Any,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.dataplane: DataPlane = self._run(start_dataplane(config, tls=dp_server_tls))
        config_cp = ControlPlaneConfig(model=str(model), dataplanes=(self.dataplane.address,), **cp_kwargs)
        self.controlplane: ControlPlane = self._run(self._start_cp(config_cp))
        self.grpc_address = f"127.0.0.1:{self.controlplane.grpc_port}"
        self.http_url = f"http://127.0.0.1:{self.controlplane.http_port}"

    @staticmethod
    async def _start_cp(config: ControlPlaneConfig) -> ControlPlane:
        cp = await start_control_plane(config, "127.0.0.1", 0, http_port=0)
        assert await cp.dispatcher.wait_ready(10.0)
        return cp

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=120)

    def state(self) -> dataplane_pb2.GetStateResponse:
        return self._run(get_state(self.dataplane.address))

    def wait_idle(self, timeout_s: float = 10.0) -> dataplane_pb2.GetStateResponse:
        return self._run(wait_idle(self.dataplane.address, timeout_s))

    def close(self) -> None:
        self._run(self.controlplane.stop())
        self._run(self.dataplane.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
