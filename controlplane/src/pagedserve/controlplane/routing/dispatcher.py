"""The control plane's core: admission, prefix-hash lookup, budget, routing, dispatch, failover.

Transport-neutral: the gRPC servicer and the OpenAI HTTP front end hand it a validated
`GenerationRequest` (built by the Frontend) and consume `generate()`'s events. The decisions
(where a request runs, whether it may move after a failure) are pure functions in
`pagedserve.controlplane.routing.placement`; this class snapshots the links for them and carries them out. All
state here is soft: the data-plane links rebuild it from snapshots and events after a restart.

The set of data planes: the static `--dataplane` addresses plus what `--dataplane-dns`
resolves to, re-resolved every `dns_refresh_s` through an injectable `Resolver`. A new address
joins on the next refresh; one that leaves retires: placement skips it at once, its link stays
up until its requests in flight end (at most `dataplane_drain_timeout_s`), then closes. If it
comes back meanwhile it is back in rotation on the same link. `stop_accepting` (shutdown)
refuses new generations while those in progress go on; `wait_finished` waits for them;
`cut` ends those still under way (the shutdown grace is over).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

from pagedserve.common.log import get_logger
from pagedserve.common.telemetry import extract, tracer
from pagedserve.controlplane.config import ControlPlaneConfig
from pagedserve.controlplane.deadlines import timeout_ms
from pagedserve.controlplane.errors import ServiceError
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.admission import HELD_BACK, AdmissionQueue, HeldBack
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection, Lost, RequestEvent
from pagedserve.controlplane.routing.discovery import Resolver, resolve_dataplanes
from pagedserve.controlplane.routing.link_snapshots import PromptHashes, link_snapshots, prompt_hashes
from pagedserve.controlplane.routing.placement import (
    LinkSnapshot,
    Refusal,
    Wait,
    plan_placement,
    retry_on_other,
)
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.controlplane.tenancy.auth import tenant_names
from pagedserve.controlplane.tenancy.tenant_limits import TenantLimits
from pagedserve.controlplane.tenancy.tenants import policies as tenant_policies
from pagedserve.protos.pagedserve.v1 import dataplane_pb2

log = get_logger(__name__)
_tracer = tracer(__name__)

_RETIRE_POLL_S = 0.05
# A data plane drops a request at its deadline (SubmitCommand.timeout_ms) and says so. Should it
# not (a step that hangs, a data plane that predates the field), the control plane ends the
# call itself this long after the deadline: longer than a step, so the data plane's answer,
# which says where the request was, normally comes first.
DEADLINE_GRACE_S = 5.0
_SHUTTING_DOWN = "the control plane is shutting down; retry the request"


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
    def __init__(self, config: ControlPlaneConfig, resolver: Resolver = resolve_dataplanes) -> None:
        """`resolver` turns `config.dataplane_dns` into addresses (default: the DNS lookup)."""
        self.config = config
        self.resolver = resolver
        self.index = PrefixIndex()
        self.connections: dict[str, DataPlaneConnection] = {}
        # Tenants (controlplane/src/pagedserve/controlplane/tenancy/tenants.py): their weights order the admission queue, their
        # limits refuse a request before it queues, and with two or more of them a data plane
        # gets new requests only while ours that wait there for a first token reserve less
        # than about a step of prefill (`tenant_dispatch_tokens`): the rest wait here, where
        # tenants take turns.
        names = tenant_names(config.api_keys, config.api_key_tenants)
        policies = tenant_policies(names, config.tenant_settings)
        self.tenants = TenantLimits(policies)
        pending = config.tenant_dispatch_tokens
        self._pending_tokens = pending if pending and len(names) > 1 else None
        self._several_tenants = len(names) > 1
        self.admission: AdmissionQueue[Reservation] = AdmissionQueue(
            config.max_queue_len,
            config.queue_timeout_s,
            release=self._release_reservation,
            weights={t: p.weight for t, p in policies.items()},
        )
        self._discovery: asyncio.Task[None] | None = None
        self._retiring: dict[str, asyncio.Task[None]] = {}  # address -> its drain-then-close task
        self._retire_tasks: set[asyncio.Task[None]] = set()  # those, until done (closing included)
        self._accepting = True
        self._in_progress = 0  # generate() calls under way
        self._finished = asyncio.Event()  # set while none is
        self._finished.set()
        self._cut: str | None = None  # why every generation under way was ended (`cut`)
        self.changed = asyncio.Event()  # set whenever a data-plane link reports (health, stats)
        self._started = asyncio.Event()  # set once a data plane has served, or on shutdown
        self.waiting_for_startup = 0  # requests waiting in `wait_for_startup` now

    # -- data-plane set -------------------------------------------------------------------------
    async def start(self) -> None:
        for address in self.config.dataplanes:
            self.add_dataplane(address)
        if self.config.dataplane_dns:
            await self._refresh_dns()
            self._discovery = asyncio.create_task(self._discover(), name="dataplane-dns")

    async def stop(self) -> None:
        self._accepting = False
        if self._discovery is not None:
            self._discovery.cancel()
        for task in self._retiring.values():
            task.cancel()  # (still draining: its link is closed with the others below)
        await asyncio.gather(*self._retire_tasks, return_exceptions=True)
        self._retiring.clear()
        self.admission.fail_all(ServiceError("UNAVAILABLE", "the control plane is shutting down"))
        await asyncio.gather(*(c.close() for c in self.connections.values()))
        self.connections.clear()

    # -- shutdown -------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """False once shutting down: new generations are refused UNAVAILABLE."""
        return self._accepting

    @property
    def in_progress(self) -> int:
        """Generations under way (queued for budget or streaming)."""
        return self._in_progress

    def stop_accepting(self) -> None:
        """Refuse new generations from now on (UNAVAILABLE); those under way go on. Health
        turns NOT_SERVING (`healthy` is empty from now on)."""
        if self._accepting:
            self._accepting = False
            log.info("controlplane_draining", in_progress=self._in_progress)
            self._on_link_change()

    async def wait_finished(self, timeout_s: float) -> bool:
        """True once no generation is under way, False if some still are after `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._finished.wait(), timeout_s)
        return self._in_progress == 0

    def cut(self, message: str) -> int:
        """End every generation under way now, and refuse new ones: each raises ServiceError
        UNAVAILABLE `message` to its consumer (an SSE stream ends with it as an error event,
        a gRPC stream with it as its status) and is aborted on its data plane, its blocks
        freed. Those queued for budget leave the queue. Returns how many were under way.

        Only wakes them: each ends when its own task next runs, so a client that does not
        read can hold its response open; the ports' stop bounds that (`ControlPlane.stop`)."""
        self.stop_accepting()
        self._cut = message
        self.admission.fail_all(ServiceError("UNAVAILABLE", message))
        for link in self.connections.values():
            for handle in link.handles.values():  # a stream waiting for its next event wakes
                handle.events.put_nowait(Lost(message))
        return self._in_progress

    def _check_cut(self) -> None:
        if self._cut is not None:
            raise ServiceError("UNAVAILABLE", self._cut)

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
        if not self._started.is_set() and (self.healthy or not self._accepting):
            self._started.set()

    async def wait_for_startup(self, deadline: float | None = None) -> None:
        """Start-up: until a data plane first serves, a new request waits here for one, at most
        `dataplane_wait_s` (or until its `deadline`, monotonic), rather than failing at once in
        the window between the ports opening and the model loading; it then runs, or is refused
        UNAVAILABLE as before. Once one has served (or on shutdown) nothing waits: a data plane
        lost later fails or re-routes requests at once, and clients retry."""
        if self._started.is_set():
            return
        bound = self.config.dataplane_wait_s
        if deadline is not None:
            bound = min(bound, max(0.0, deadline - time.monotonic()))
        self.waiting_for_startup += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._started.wait(), bound)
        finally:
            self.waiting_for_startup -= 1

    async def remove_dataplane(self, address: str) -> None:
        """Close the link to `address` now (requests in flight there are lost)."""
        task = self._retiring.pop(address, None)
        if task is not None:
            task.cancel()
        link = self.connections.pop(address, None)
        if link is not None:
            await link.close()
            log.info("dataplane_removed", address=address)

    @property
    def retiring(self) -> frozenset[str]:
        """Addresses that left discovery and are finishing their requests in flight."""
        return frozenset(self._retiring)

    def retire_dataplane(self, address: str) -> None:
        """`address` left discovery: place nothing more there, close its link once its
        requests in flight have ended (or after `dataplane_drain_timeout_s`)."""
        link = self.connections.get(address)
        if link is None or address in self._retiring or link.closing:
            return
        task = asyncio.create_task(self._retire(link), name=f"dataplane-retire-{address}")
        self._retiring[address] = task
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)
        log.info("dataplane_retiring", address=address, in_flight=len(link.handles))
        self._on_link_change()

    def _reinstate(self, address: str) -> None:
        """A retiring address is back in discovery: back in rotation, on the same link."""
        task = self._retiring.pop(address, None)
        if task is not None:
            task.cancel()
            log.info("dataplane_reinstated", address=address)
            self._on_link_change()

    async def _retire(self, link: DataPlaneConnection) -> None:
        timeout_s = self.config.dataplane_drain_timeout_s
        deadline = time.monotonic() + timeout_s
        while link.handles and time.monotonic() < deadline:
            await asyncio.sleep(_RETIRE_POLL_S)
        # Past this point the link goes, even if the address comes back (it rejoins afresh on a
        # later refresh): it is no longer "retiring", and close() marks it unusable at once.
        self._retiring.pop(link.address, None)
        cut = len(link.handles)
        reason = f"it left discovery and its requests outlived the drain timeout ({timeout_s:g} s)"
        try:
            await link.close(reason)
        finally:
            if self.connections.get(link.address) is link:
                del self.connections[link.address]
            if cut:
                log.warning("dataplane_removed", address=link.address, cut=cut, reason=reason)
            else:
                log.info("dataplane_removed", address=link.address, drained=True)
            self._on_link_change()

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
            try:
                await self._refresh_dns()
            except OSError as exc:  # the name does not resolve now: keep the set as it is
                log.warning("dns_refresh_failed", name=self.config.dataplane_dns, error=str(exc))
            except Exception:
                log.exception("dns_refresh_failed", name=self.config.dataplane_dns)

    async def _refresh_dns(self) -> None:
        """Join what discovery added, retire what it removed, reinstate what came back."""
        assert self.config.dataplane_dns is not None
        found = set(await self.resolver(self.config.dataplane_dns))
        static = set(self.config.dataplanes)
        for address in sorted(found):
            if address in self._retiring:
                self._reinstate(address)
            elif address not in self.connections:
                self.add_dataplane(address)
        for address in sorted(set(self.connections) - found - static):
            self.retire_dataplane(address)

    @property
    def healthy(self) -> list[DataPlaneConnection]:
        """The links new requests may go to: connected, configured, not draining, not retiring
        (none once the control plane is shutting down)."""
        if not self._accepting:
            return []
        return [
            c
            for c in self.connections.values()
            if c.healthy and c.info is not None and c.address not in self._retiring
        ]

    # -- placement ------------------------------------------------------------------------------
    def snapshots(self, hashes: PromptHashes, tenant: str = "") -> list[LinkSnapshot]:
        """Every link that has told us its configuration, as placement sees it for one request
        (of `tenant`: with several tenants, what it holds there counts apart)."""
        links = [c for c in self.connections.values() if c.address not in self._retiring]
        return link_snapshots(links, self.index, hashes, tenant, self._pending_tokens, self.admission.weights)

    def _place(
        self, request: GenerationRequest, exclude: frozenset[str], hashes: PromptHashes
    ) -> Reservation | HeldBack | None:
        """The admission queue's placer: a reservation, None to wait (HELD_BACK: only its
        tenant's dispatch cap stops it), or ServiceError."""
        plan = plan_placement(
            request,
            self.snapshots(hashes, request.tenant),
            self.config.routing,
            self.config.decode_reserve_blocks,
            exclude,
        )
        if isinstance(plan, Refusal):
            raise ServiceError(plan.code, plan.message, param=plan.param)
        if isinstance(plan, Wait):
            return HELD_BACK if plan.held_back else None
        link = self.connections[plan.dataplane]
        link.budget.reserve(request.request_id, plan.need_blocks, request.tenant)
        return Reservation(link, request.request_id, plan.need_blocks, plan.cached_blocks)

    @staticmethod
    def _release_reservation(reservation: Reservation) -> None:
        reservation.connection.budget.release(reservation.request_id)
        reservation.connection.on_change()

    # -- generation -----------------------------------------------------------------------------
    def abort_sample(self, request_id: str, index: int) -> bool:
        """Stop sample `index` of a request being generated (n > 1: it matched a stop string)
        on the data plane that runs it, freeing its blocks there; its siblings go on and
        `generate()` still yields its (aborted) finish. False when nothing was sent."""
        for link in self.connections.values():
            if request_id in link.handles:
                return link.abort_sample(request_id, index)
        return False

    async def generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None = None
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Admit, route and run `request`; yields Admitted, then deltas and finishes (one per
        sample). Raises ServiceError. Closing the generator early aborts the request.
        `trace_context`: the W3C context of the request's span (the data plane's spans join it)."""
        if not self._accepting:
            raise ServiceError("UNAVAILABLE", _SHUTTING_DOWN)
        # RESOURCE_EXHAUSTED past the tenant's limits; released however the request ends.
        lease = self.tenants.acquire(request.tenant, request.num_prompt_tokens, request.max_total_tokens)
        self._in_progress += 1
        self._finished.clear()
        try:
            async with contextlib.aclosing(self._generate(request, trace_context)) as events:
                async for event in events:  # (closing this generator closes that one: abort)
                    if isinstance(event, dataplane_pb2.TokenDelta):
                        lease.generated += len(event.token_ids)
                    elif isinstance(event, Admitted):
                        lease.admitted = True
                    yield event
        finally:
            self.tenants.release(lease)
            self.admission.finished(request.request_id, lease.unused)
            self._in_progress -= 1
            if self._in_progress == 0:
                self._finished.set()

    async def _generate(
        self, request: GenerationRequest, trace_context: Mapping[str, str] | None
    ) -> AsyncGenerator[GenerationEvent, None]:
        command = request.to_proto(trace_context)  # the wire message, made once for every attempt
        if self._several_tenants:
            # The data plane shares its batch between the tenants it is sent (fair_share.py).
            command.tenant = request.tenant
            command.tenant_weight = self.admission.weights.get(request.tenant, 1.0)
        hashes = prompt_hashes(request)
        exclude: frozenset[str] = frozenset()
        streamed = False
        parent = extract(dict(trace_context or {}))
        while True:
            self._check_cut()  # (a request lost before the cut is not placed again)
            remaining = None if request.deadline is None else request.deadline - time.monotonic()
            span = _tracer.start_span("pagedserve.admission", context=parent)
            try:
                reservation, waited = await self.admission.admit(
                    functools.partial(self._place, request, exclude, hashes),
                    remaining,
                    request.priority,
                    request.tenant,
                    0 if exclude else request.max_total_tokens,  # (a retry is not charged again)
                    request.request_id,
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
            command.timeout_ms = timeout_ms(request.deadline)  # what is left of it now, per attempt
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
                    event = await _next_event(handle.events, request.deadline)
                    # Checked on every event, not only on the cut's `Lost`: the events queued
                    # before it (a slow consumer's backlog) are not streamed any more.
                    self._check_cut()
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


async def _next_event(events: asyncio.Queue[RequestEvent], deadline: float | None) -> RequestEvent:
    """The link's next event for a request; DEADLINE_EXCEEDED once `deadline` is
    DEADLINE_GRACE_S past with none."""
    if deadline is None or not events.empty():
        return await events.get()
    try:
        return await asyncio.wait_for(events.get(), deadline + DEADLINE_GRACE_S - time.monotonic())
    except TimeoutError:
        raise ServiceError(
            "DEADLINE_EXCEEDED", "the request's deadline passed and its data plane did not end it"
        ) from None


def _moved(decision: frozenset[str] | Refusal) -> frozenset[str]:
    """The data planes to leave out of the next attempt; raises the refusal that ends it."""
    if isinstance(decision, Refusal):
        raise ServiceError(decision.code, decision.message)
    return decision
