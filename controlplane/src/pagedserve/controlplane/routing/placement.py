"""Where a request runs, and whether it may move: pure decisions over snapshots.

The Dispatcher takes a `LinkSnapshot` of each data-plane link (health, limits, block budget,
load, and how much of this request's prompt it caches), asks `plan_placement` where the
request goes and carries the answer out (reserving blocks, submitting). When a data plane is
lost mid-request, `retry_on_other` says whether the request may run elsewhere. Nothing here
reads a clock, a link or the network, so every decision is testable from plain values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.common.admission_rules import refusal
from pagedserve.common.block_hash import cdiv
from pagedserve.controlplane.config import RoutingWeights
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.router import Candidate, choose

NO_DATAPLANE = "no data plane is available to run this request"


@dataclass(frozen=True)
class LinkSnapshot:
    """One data-plane link as placement sees it, at one instant, for one request."""

    address: str
    healthy: bool  # connected, with its configuration received
    draining: bool
    block_size: int
    num_blocks: int  # the whole pool
    max_model_len: int
    max_num_seqs: int
    free_blocks: int  # as the data plane last reported
    reserved_blocks: int  # held by this replica for admitted requests not yet in a report
    total_blocks: int
    prompt_blocks: int  # full blocks of the request's prompt (0 when prefix caching is off there)
    cached_blocks: int  # of those, the leading ones already cached there
    num_running: int = 0
    num_waiting: int = 0
    in_flight: int = 0  # this replica's requests not yet finished there
    worst_priority: int | None = None  # the largest priority among those; None: none in flight
    # Those without a first token yet (queued there, or prefilling), the KV tokens they
    # reserve, and the most tokens there may be before no new request goes there (None: no cap).
    pending: int = 0
    pending_tokens: int = 0
    pending_token_limit: int | None = None
    share_slots: int = 0  # with tenants: those and this are the request's tenant's (router.Candidate)

    @property
    def available_blocks(self) -> int:
        return self.free_blocks - self.reserved_blocks


@dataclass(frozen=True)
class Placement:
    """Run the request on `dataplane`, reserving `need_blocks` there until it reports."""

    dataplane: str
    need_blocks: int
    cached_blocks: int


@dataclass(frozen=True)
class Refusal:
    """End the request with this status (a gRPC status name) and message."""

    code: str
    message: str
    param: str | None = None  # the request field to change, when one alone is at fault


@dataclass(frozen=True)
class Wait:
    """Some data plane could run the request, but none has the blocks for it now: queue it.
    `held_back`: one has them, but the request's tenant has its fill waiting there already."""

    held_back: bool = False


WAIT = Wait()
WAIT_HELD_BACK = Wait(held_back=True)  # (the admission queue is told so with admission.HELD_BACK)


def plan_placement(
    request: GenerationRequest,
    links: Sequence[LinkSnapshot],
    weights: RoutingWeights,
    decode_reserve_blocks: int,
    exclude: frozenset[str] = frozenset(),
) -> Placement | Refusal | Wait:
    """Where `request` runs now, why it never can, or that it must wait.

    Only healthy, non-draining data planes outside `exclude` count. One that can never run the
    request (`admission_rules.refusal`, or a reservation larger than its whole pool:
    `reservation_refusal`) is skipped; if every one is, the request is refused
    with the reason of the roomiest (longest context, then largest pool), which for a uniform
    fleet is everyone's reason. Among the rest the router picks the best that has the blocks
    now: the prompt's uncached blocks plus `decode_reserve_blocks` per sample. Priorities: a
    data plane where this replica runs a request of a strictly worse priority counts as having
    them too, since its scheduler preempts that work for this request (or queues it first).
    Tenants: a data plane where this replica's requests of the request's tenant still waiting
    for a first token reserve `pending_token_limit` tokens, or outnumber both its free batch
    slots and the tenant's share of the batch left there, has no room either
    (router.Candidate.fits): the rest wait in the admission queue, where tenants take turns.
    """
    usable = [s for s in links if s.healthy and not s.draining and s.address not in exclude]
    if not usable:
        return Refusal("UNAVAILABLE", NO_DATAPLANE)
    prompt = request.num_prompt_tokens
    if request.pooling is not None:  # prompt-only: it never decodes
        decode_reserve_blocks = 0
    candidates: list[Candidate] = []
    refused: list[tuple[LinkSnapshot, str, str | None]] = []
    for s in usable:
        reason = refusal(
            prompt,
            request.max_tokens,
            s.block_size,
            s.num_blocks,
            s.max_model_len,
            prompt_only=request.pooling is not None,
        )
        if reason is not None:
            refused.append((s, reason, None))
            continue
        reason = reservation_refusal(
            prompt, request.num_samples, s.block_size, s.num_blocks, decode_reserve_blocks
        )
        if reason is not None:
            refused.append((s, reason, "n"))  # the prompt alone fits: only fewer samples can
            continue
        need = cdiv(prompt, s.block_size) - s.cached_blocks + decode_reserve_blocks * request.num_samples
        candidates.append(
            Candidate(
                dataplane=s.address,
                prompt_blocks=s.prompt_blocks,
                cached_blocks=s.cached_blocks,
                need_blocks=max(0, need),
                available_blocks=s.available_blocks,
                total_blocks=s.total_blocks,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                in_flight=s.in_flight,
                max_num_seqs=s.max_num_seqs,
                preempts=s.worst_priority is not None and request.priority < s.worst_priority,
                pending=s.pending,
                pending_tokens=s.pending_tokens,
                pending_token_limit=s.pending_token_limit,
                share_slots=s.share_slots,
            )
        )
    if not candidates:
        _, reason, param = max(refused, key=lambda r: (r[0].max_model_len, r[0].num_blocks))
        return Refusal("INVALID_ARGUMENT", reason, param)
    best = choose(candidates, weights)
    if best is None:
        return WAIT_HELD_BACK if any(c.held_back for c in candidates) else WAIT
    return Placement(best.dataplane, best.need_blocks, best.cached_blocks)


def reservation_refusal(
    prompt_tokens: int, num_samples: int, block_size: int, num_blocks: int, decode_reserve_blocks: int
) -> str | None:
    """Why the reservation of a request (all its samples) can never be made on a pool of
    `num_blocks`, or None if it can.

    A request reserves its prompt's blocks plus `decode_reserve_blocks` per sample. The test
    assumes nothing cached (a cached prefix can be evicted at any time), so a request is either
    always refused here or admitted once the pool has room: admission never queues a request
    that waits for blocks which cannot exist (n = 10000 on a 64-block pool).
    """
    prompt_blocks = cdiv(prompt_tokens, block_size)
    need = prompt_blocks + decode_reserve_blocks * num_samples
    if need <= num_blocks:
        return None
    return (
        f"the request's {num_samples} sample(s) reserve {need} KV blocks ({prompt_blocks} for the prompt "
        f"+ {decode_reserve_blocks} per sample) but the whole pool has only {num_blocks}; lower n"
    )


def retry_on_other(
    lost: str, reason: str, streamed: bool, exclude: frozenset[str]
) -> frozenset[str] | Refusal:
    """After data plane `lost` dropped the request (`reason`): the data planes to leave out
    when placing it again, or the refusal that ends it.

    Only a request that has streamed nothing moves: a client already holding tokens from one
    data plane cannot be given a continuation sampled elsewhere.
    """
    if streamed:
        return Refusal("UNAVAILABLE", f"{reason} while streaming; retry the request")
    return exclude | {lost}
