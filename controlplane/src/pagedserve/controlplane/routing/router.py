"""Routing: pick the data plane for a request from its cached prefix and its load.

Each candidate that can take the request now (its free-block budget covers what the request
needs there) gets

    score = prefix_weight · cached_blocks / prompt_blocks
          − usage_weight  · (1 − (available_blocks − need_blocks) / total_blocks)
          − load_weight   · max(running + waiting, in_flight) / max_num_seqs

and the highest score wins; ties go to the fewest in-flight requests, then the address.
The prefix term is in [0, 1] (1 = the whole prompt is cached there); the usage term is the
fraction of the pool in use after admitting; the load term counts requests relative to the
data plane's batch capacity (the reported running + waiting lag a step behind, so a burst
this replica just sent counts through its own in-flight number). With the defaults, a fully cached prompt outweighs a pool that
is half full or a batch that is half busy, while unrelated requests spread to the least
loaded data plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagedserve.controlplane.config import RoutingWeights

MIN_PENDING = 4  # requests a data plane with a full batch may hold waiting, with tenants


@dataclass(frozen=True)
class Candidate:
    dataplane: str
    prompt_blocks: int  # full blocks of the prompt (the part the prefix cache can serve)
    cached_blocks: int  # of those, already cached on this data plane
    need_blocks: int  # what admitting the request here reserves
    available_blocks: int  # reported free minus reserved
    total_blocks: int
    num_running: int
    num_waiting: int
    in_flight: int  # this replica's requests not yet finished there
    max_num_seqs: int
    preempts: bool = False  # it runs work of a worse priority than the request's: room for it
    # With several tenants, no new request while this replica's requests there without a first
    # token yet (`pending`) reserve `pending_token_limit` KV tokens (about a step of prefill),
    # or fill its free batch slots (MIN_PENDING at least, so a slot that frees finds one
    # there): the rest wait in the control plane's fair queue rather than in the data plane's
    # first-come-first-served one, where they would sit ahead of every other tenant's.
    # Those are counted per tenant (the request's), and a tenant may also fill `share_slots`,
    # what its weighted share of the batch leaves it there: the data plane's scheduler makes
    # room for those by preempting a tenant over its share.
    pending: int = 0
    pending_tokens: int = 0
    pending_token_limit: int | None = None
    share_slots: int = 0

    @property
    def fits(self) -> bool:
        if self.preempts:
            return True
        return not self.capped and self.need_blocks <= self.available_blocks

    @property
    def capped(self) -> bool:
        """The request's tenant has its fill of requests waiting here for a first token."""
        if self.pending_token_limit is None:
            return False
        free_slots = self.max_num_seqs - self.num_running
        return self.pending_tokens >= self.pending_token_limit or self.pending >= max(
            MIN_PENDING, free_slots, self.share_slots
        )

    @property
    def held_back(self) -> bool:
        """It has the blocks, and only its tenant's cap holds the request back."""
        return not self.preempts and self.capped and self.need_blocks <= self.available_blocks


def share_slots(
    max_num_seqs: int, tenant: str, weights: Mapping[str, float], in_flight: Mapping[str, int]
) -> int:
    """Batch slots `tenant` may still take on a data plane by its weighted share: its share of
    `max_num_seqs` among the tenants with requests in flight there (itself included), less its
    own in flight there. `weights`: a tenant not named has weight 1."""
    present = {t for t, n in in_flight.items() if n > 0} | {tenant}
    total = sum(weights.get(t, 1.0) for t in present)
    fair = max_num_seqs * weights.get(tenant, 1.0) / total
    return int(fair) - in_flight.get(tenant, 0)


def score(c: Candidate, weights: RoutingWeights) -> float:
    prefix = c.cached_blocks / c.prompt_blocks if c.prompt_blocks else 0.0
    used_after = 1.0 - (c.available_blocks - c.need_blocks) / c.total_blocks if c.total_blocks else 1.0
    load = max(c.num_running + c.num_waiting, c.in_flight) / max(1, c.max_num_seqs)
    return weights.prefix_weight * prefix - weights.usage_weight * used_after - weights.load_weight * load


def choose(candidates: Iterable[Candidate], weights: RoutingWeights) -> Candidate | None:
    """The best candidate that fits, or None when none does."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (-score(c, weights), c.in_flight, c.dataplane))
