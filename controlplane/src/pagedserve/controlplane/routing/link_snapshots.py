"""What placement sees of each data-plane link, for one request, at one instant.

The dispatcher hands `plan_placement` (controlplane/src/pagedserve/controlplane/routing/placement.py) a `LinkSnapshot` per link:
its configuration and health, the block budget this replica keeps for it, its load, how much
of the request's prompt it caches (through the prefix index), and, with several tenants, what
the request's tenant holds there (its requests waiting for a first token, its share of the
batch left). Reading the links is all this does; the decisions stay pure in placement.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from pagedserve.common.block_hash import first_block_extra_keys, hash_request_blocks
from pagedserve.controlplane.request import GenerationRequest
from pagedserve.controlplane.routing.dataplane_client import DataPlaneConnection
from pagedserve.controlplane.routing.placement import LinkSnapshot
from pagedserve.controlplane.routing.prefix_index import PrefixIndex
from pagedserve.controlplane.routing.router import share_slots

PromptHashes = Callable[[int, str], list[bytes]]
"""The chained block hashes of a request's prompt for a (block_size, hash seed)."""


def prompt_hashes(request: GenerationRequest) -> PromptHashes:
    """Memoized per data-plane hashing scheme: a request is placed (and re-placed) many times."""
    extra = first_block_extra_keys(request.cache_salt)

    @functools.cache
    def hashes(block_size: int, seed: str) -> list[bytes]:
        return list(hash_request_blocks(request.prompt_token_ids, block_size, seed, extra))

    return hashes


def link_snapshots(
    links: Iterable[DataPlaneConnection],
    index: PrefixIndex,
    hashes: PromptHashes,
    tenant: str,
    pending_token_limit: int | None,
    weights: Mapping[str, float],
) -> list[LinkSnapshot]:
    """A snapshot of each of `links` that has told us its configuration and is not closing.
    `pending_token_limit` set (several tenants): the pending counts are `tenant`'s, and its
    share of each batch (by `weights`, 1 for a tenant not named) is computed."""
    out = []
    for link in links:
        info = link.info
        if info is None or link.closing:
            continue
        cacheable = info.enable_prefix_caching and link.healthy
        pending, pending_blocks, slots = link.budget.num_reserved, link.budget.reserved_blocks, 0
        if pending_token_limit is not None:
            pending, pending_blocks = link.budget.reserved_by(tenant)
            in_flight = Counter(h.tenant for h in link.handles.values())
            slots = share_slots(info.max_num_seqs, tenant, weights, in_flight)
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
                cached_blocks=index.cached_prefix_blocks(link.address, prompt),
                num_running=link.stats.num_running,
                num_waiting=link.stats.num_waiting,
                in_flight=len(link.handles),
                worst_priority=max((h.priority for h in link.handles.values()), default=None),
                pending=pending,
                pending_tokens=pending_blocks * info.block_size,
                pending_token_limit=pending_token_limit,
                share_slots=slots,
            )
        )
    return out
