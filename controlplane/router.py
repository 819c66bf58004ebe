"""Routing: pick the data plane for a request from its cached prefix and its load. No torch.

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

from collections.abc import Iterable
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
    pending: int = 0
    pending_tokens: int = 0
    pending_token_limit: int | None = None

    @property
    def fits(self) -> bool:
        if self.preempts:
            return True
        if self.pending_token_limit is not None:
            free_slots = self.max_num_seqs - self.num_running
            if self.pending_tokens >= self.pending_token_limit or self.pending >= max(
                MIN_PENDING, free_slots
            ):
                return False
        return self.need_blocks <= self.available_blocks


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
