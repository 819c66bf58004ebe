"""The control plane's core: admission, prefix-hash lookup, budget, routing, dispatch, failover.

Transport-neutral: the gRPC servicer and the OpenAI HTTP front end hand it a validated
`GenerationRequest` (built by the Frontend) and consume `generate()`'s events. The decisions
(where a request runs, whether it may move after a failure) are pure functions in
`controlplane.placement`; this class snapshots the links for them and carries them out. All
state here is soft: the data-plane links rebuild it from snapshots and events after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass

from controlplane.admission import AdmissionQueue
from controlplane.config import ControlPlaneConfig
from controlplane.dataplane_client import DataPlaneConnection, Lost
from controlplane.discovery import resolve_dataplanes
from controlplane.errors import ServiceError
from controlplane.placement import LinkSnapshot, Refusal, Wait, plan_placement, retry_on_other
from controlplane.prefix_index import PrefixIndex
from controlplane.request import GenerationRequest
from pagedserve.common.block_hash import first_block_extra_keys, hash_request_blocks
from pagedserve.common.log import get_logger
from pagedserve.common.telemetry import extract, tracer
from protos.pagedserve.v1 import dataplane_pb2

log = get_logger(__name__)
_tracer = tracer(__name__)

PromptHashes = Callable[[int, str], list[bytes]]
"""The chained block hashes of a request's prompt for a (block_size, hash seed)."""


def prompt_hashes(request: GenerationRequest) -> PromptHashes:
    """Memoized per data-plane hashing scheme: a request is placed (and re-placed) many times."""
    extra = first_block_extra_keys(request.cache_salt)

    @functools.cache
    def hashes(block_size: int, seed: str) -> list[bytes]:
        return list(hash_request_blocks(request.prompt_token_ids, block_size, seed, extra))

    return hashes


@dataclass(frozen=True)
class Reservation:
    """A placement carried out: `need_blocks` reserved on `connection` for the request."""

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
        self.admission: AdmissionQueue[Reservation] = AdmissionQueue(
            config.max_queue_len, config.queue_timeout_s, release=self._release_reservation
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
            token=self.config.dataplane_token,
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
    def snapshots(self, hashes: PromptHashes) -> list[LinkSnapshot]:
        """Every link that has told us its configuration, as placement sees it for one request."""
        out = []
        for link in self.connections.values():
            info = link.info
            if info is None:
                continue
            cacheable = info.enable_prefix_caching and link.healthy
            prompt = hashes(info.block_size, info.prefix_hash_seed) if cacheable else []
            out.append(
                LinkSnapshot(
                    address=link.address,
                    healthy=link.healthy,
                    draining=link.stats.draining,
                    block_size=info.block_size,
                    num_blocks=info.num_blocks,
                    max_model_len=info.max_model_len,
                    max_num_seqs=info.max_num_seqs,
                    free_blocks=link.budget.reported_free_blocks,
                    reserved_blocks=link.budget.reserved_blocks,
                    total_blocks=link.budget.total_blocks or info.num_blocks,
                    prompt_blocks=len(prompt),
                    cached_blocks=self.index.cached_prefix_blocks(link.address, prompt),
                    num_running=link.stats.num_running,
                    num_waiting=link.stats.num_waiting,
                    in_flight=len(link.handles),
                )
            )
        return out

    def _place(
        self, request: GenerationRequest, exclude: frozenset[str], hashes: PromptHashes
    ) -> Reservation | None:
        """The admission queue's placer: a reservation, None to wait, or ServiceError."""
        plan = plan_placement(
            request, self.snapshots(hashes), self.config.routing, self.config.decode_reserve_blocks, exclude
        )
        if isinstance(plan, Refusal):
            raise ServiceError(plan.code, plan.message)
        if isinstance(plan, Wait):
            return None
        link = self.connections[plan.dataplane]
        link.budget.reserve(request.request_id, plan.need_blocks)
        return Reservation(link, request.request_id, plan.need_blocks, plan.cached_blocks)

    @staticmethod
    def _release_reservation(reservation: Reservation) -> None:
        reservation.connection.budget.release(reservation.request_id)
        reservation.connection.on_change()

    # -- generation -----------------------------------------------------------------------------
    async def generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Admit, route and run `request`; yields Admitted, then deltas and finishes (one per
        sample). Raises ServiceError. Closing the generator early aborts the request.
        `trace_context`: the W3C context of the request's span (the data plane's spans join it)."""
        command = request.to_proto(trace_context)  # the wire message, made once for every attempt
        hashes = prompt_hashes(request)
        exclude: frozenset[str] = frozenset()
        streamed = False
        parent = extract(dict(trace_context or {}))
        while True:
            remaining = None if request.deadline is None else request.deadline - time.monotonic()
            span = _tracer.start_span("pagedserve.admission", context=parent)
            try:
                reservation, waited = await self.admission.admit(
                    functools.partial(self._place, request, exclude, hashes), remaining
                )
                link = reservation.connection
                span.set_attributes(
                    {
                        "pagedserve.queue_seconds": waited,
                        "pagedserve.dataplane": link.address,
                        "pagedserve.cached_blocks": reservation.cached_blocks,
                        "pagedserve.reserved_blocks": reservation.need_blocks,
                        "pagedserve.attempt": len(exclude) + 1,
                    }
                )
            finally:
                span.end()
            try:
                handle = link.submit(command)
            except RuntimeError as exc:  # the link broke between placement and submit
                link.budget.release(request.request_id)
                exclude = _moved(retry_on_other(link.address, str(exc), streamed, exclude))
                continue
            yield Admitted(link.address, waited, reservation.cached_blocks)
            finished = 0
            done = False
            try:
                while not done:
                    event = await handle.events.get()
                    if isinstance(event, Lost):
                        exclude = _moved(retry_on_other(link.address, event.message, streamed, exclude))
                        log.warning("rerouting", request_id=request.request_id, lost=link.address)
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


def _moved(decision: frozenset[str] | Refusal) -> frozenset[str]:
    """The data planes to leave out of the next attempt; raises the refusal that ends it."""
    if isinstance(decision, Refusal):
        raise ServiceError(decision.code, decision.message)
    return decision
