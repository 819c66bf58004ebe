"""The control plane's core: admission, prefix-hash lookup, budget, routing, dispatch, failover.

Transport-neutral: the gRPC servicer (and the OpenAI HTTP front end) turn client requests
into a `GenerationRequest` and consume `generate()`'s events. All state here is soft: the
data-plane links rebuild it from snapshots and events after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from controlplane.admission import AdmissionQueue
from controlplane.config import ControlPlaneConfig
from controlplane.dataplane_client import DataPlaneConnection, Lost
from controlplane.discovery import resolve_dataplanes
from controlplane.errors import ServiceError
from controlplane.prefix_index import PrefixIndex
from controlplane.router import Candidate, choose
from pagedserve.common.block_hash import cdiv, first_block_extra_keys, hash_request_blocks
from pagedserve.common.log import get_logger
from pagedserve.common.telemetry import extract, tracer
from protos.pagedserve.v1 import common_pb2, dataplane_pb2

log = get_logger(__name__)
_tracer = tracer(__name__)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: common_pb2.SamplingParams  # validated by the caller
    num_samples: int
    max_tokens: int
    cache_salt: str | None = None
    deadline: float | None = None  # time.monotonic() value
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C context of the request span
    _hashes: dict[tuple[int, str], list[bytes]] = field(default_factory=dict)

    def block_hashes(self, block_size: int, seed: str) -> list[bytes]:
        key = (block_size, seed)
        if key not in self._hashes:
            extra = first_block_extra_keys(self.cache_salt)
            self._hashes[key] = list(hash_request_blocks(self.prompt_token_ids, block_size, seed, extra))
        return self._hashes[key]


@dataclass(frozen=True)
class Placement:
    connection: DataPlaneConnection
    request_id: str
    need_blocks: int
    cached_blocks: int


@dataclass(frozen=True)
class Admitted:
    """First event of a generation: where it runs and how long it queued."""

    dataplane: str
    queue_seconds: float
    cached_blocks: int


GenerationEvent = Admitted | dataplane_pb2.TokenDelta | dataplane_pb2.RequestFinished


class Dispatcher:
    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.index = PrefixIndex()
        self.connections: dict[str, DataPlaneConnection] = {}
        self.admission: AdmissionQueue[Placement] = AdmissionQueue(
            config.max_queue_len, config.queue_timeout_s, release=self._release_placement
        )
        self._discovery: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()  # set whenever a data-plane link reports (health, stats)

    # -- data-plane set -------------------------------------------------------------------------
    async def start(self) -> None:
        for address in self.config.dataplanes:
            self.add_dataplane(address)
        if self.config.dataplane_dns:
            await self._refresh_dns()
            self._discovery = asyncio.create_task(self._discover(), name="dataplane-dns")

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        self.admission.fail_all(ServiceError("UNAVAILABLE", "the control plane is shutting down"))
        await asyncio.gather(*(c.close() for c in self.connections.values()))
        self.connections.clear()

    def add_dataplane(self, address: str) -> None:
        if address in self.connections:
            return
        link = DataPlaneConnection(
            address,
            self.index,
            on_change=self._on_link_change,
            backoff_s=self.config.reconnect_backoff_s,
            backoff_max_s=self.config.reconnect_backoff_max_s,
            tls=self.config.dataplane_tls,
        )
        self.connections[address] = link
        link.start()
        log.info("dataplane_added", address=address)

    def _on_link_change(self) -> None:
        self.admission.poke()
        self.changed.set()

    async def remove_dataplane(self, address: str) -> None:
        link = self.connections.pop(address, None)
        if link is not None:
            await link.close()
            log.info("dataplane_removed", address=address)

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once at least one data plane is connected (or False after `timeout_s`)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if any(c.healthy for c in self.connections.values()):
                return True
            await asyncio.sleep(0.05)
        return any(c.healthy for c in self.connections.values())

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_refresh_s)
            with contextlib.suppress(OSError):
                await self._refresh_dns()

    async def _refresh_dns(self) -> None:
        assert self.config.dataplane_dns is not None
        found = set(await resolve_dataplanes(self.config.dataplane_dns))
        static = set(self.config.dataplanes)
        for address in found - set(self.connections):
            self.add_dataplane(address)
        for address in set(self.connections) - found - static:
            await self.remove_dataplane(address)

    @property
    def healthy(self) -> list[DataPlaneConnection]:
        return [c for c in self.connections.values() if c.healthy and c.info is not None]

    # -- placement ------------------------------------------------------------------------------
    def _place(self, request: GenerationRequest, exclude: set[str]) -> Placement | None:
        links = [c for c in self.healthy if c.address not in exclude]
        if not links:
            raise ServiceError("UNAVAILABLE", "no data plane is available to run this request")
        prompt_len = len(request.prompt_token_ids)
        longest = max(c.info.max_model_len for c in links if c.info)
        if prompt_len >= longest:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"prompt: {prompt_len} tokens, but max_model_len is {longest} "
                "(the prompt must leave room for at least one generated token)",
            )
        candidates: list[Candidate] = []
        largest_pool = 0
        whole_need = 0
        for link in links:
            info = link.info
            assert info is not None
            bs = info.block_size
            total_tokens = min(prompt_len + request.max_tokens, info.max_model_len)
            whole_need = cdiv(total_tokens, bs)
            largest_pool = max(largest_pool, info.num_blocks)
            if prompt_len >= info.max_model_len or whole_need > info.num_blocks:
                continue
            hashes = request.block_hashes(bs, info.prefix_hash_seed) if info.enable_prefix_caching else []
            cached = self.index.cached_prefix_blocks(link.address, hashes)
            need = cdiv(prompt_len, bs) - cached + self.config.decode_reserve_blocks * request.num_samples
            candidates.append(
                Candidate(
                    dataplane=link.address,
                    prompt_blocks=len(hashes),
                    cached_blocks=cached,
                    need_blocks=max(0, need),
                    available_blocks=link.budget.available_blocks,
                    total_blocks=link.budget.total_blocks or info.num_blocks,
                    num_running=link.stats.num_running,
                    num_waiting=link.stats.num_waiting,
                    in_flight=len(link.handles),
                    max_num_seqs=info.max_num_seqs,
                )
            )
        if not candidates:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"prompt plus max_tokens needs {whole_need} KV blocks, more than the largest data plane's "
                f"whole pool ({largest_pool} blocks); lower max_tokens or shorten the prompt",
            )
        best = choose(candidates, self.config.routing)
        if best is None:
            return None
        link = self.connections[best.dataplane]
        link.budget.reserve(request.request_id, best.need_blocks)
        return Placement(link, request.request_id, best.need_blocks, best.cached_blocks)

    @staticmethod
    def _release_placement(placement: Placement) -> None:
        placement.connection.budget.release(placement.request_id)
        placement.connection.on_change()

    # -- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """Admit, route and run `request`; yields Admitted, then deltas and finishes (one per
        sample). Raises ServiceError. Closing the generator early aborts the request."""
        exclude: set[str] = set()
        streamed = False
        parent = extract(request.trace_context)
        while True:
            remaining = None if request.deadline is None else request.deadline - time.monotonic()
            span = _tracer.start_span("pagedserve.admission", context=parent)
            try:
                placement, waited = await self.admission.admit(
                    lambda: self._place(request, exclude), remaining
                )
                link = placement.connection
                span.set_attributes(
                    {
                        "pagedserve.queue_seconds": waited,
                        "pagedserve.dataplane": link.address,
                        "pagedserve.cached_blocks": placement.cached_blocks,
                        "pagedserve.reserved_blocks": placement.need_blocks,
                        "pagedserve.attempt": len(exclude) + 1,
                    }
                )
            finally:
                span.end()
            try:
                handle = link.submit(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.cache_salt,
                    request.trace_context,
                )
            except RuntimeError:  # the link broke between placement and submit
                link.budget.release(request.request_id)
                exclude.add(link.address)
                continue
            yield Admitted(link.address, waited, placement.cached_blocks)
            finished = 0
            done = False
            try:
                while not done:
                    event = await handle.events.get()
                    if isinstance(event, Lost):
                        if streamed:
                            raise ServiceError(
                                "UNAVAILABLE", f"{event.message} while streaming; retry the request"
                            )
                        log.warning("rerouting", request_id=request.request_id, lost=link.address)
                        exclude.add(link.address)
                        break
                    if isinstance(event, dataplane_pb2.SubmitRejected):
                        done = True
                        raise ServiceError(event.code, event.message)
                    if isinstance(event, dataplane_pb2.TokenDelta):
                        streamed = True
                    else:
                        finished += 1
                        done = finished >= request.num_samples
                    yield event
            finally:
                if done:
                    link.finish(request.request_id)
                else:
                    link.abort(request.request_id)  # cancelled, closed early or failed: free its blocks
            if done:
                return
