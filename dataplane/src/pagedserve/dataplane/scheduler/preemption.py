"""Which way a running request is preempted: swap (its blocks copied to the host pool) or
recompute (its blocks freed). Imports no torch.

`preemption_mode` "recompute" never swaps, "swap" always does while the host pool has room
for the victim, and "auto" picks per victim by estimated cost, in tokens' worth of work:
recomputing costs its computed tokens not held by another request in the prefix cache;
swapping costs a fixed overhead plus each block moved out and back in (less those shared
ones, which the swap-in finds cached) at `per_token` of a recompute per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.dataplane.kvcache import KVCacheManager
from pagedserve.dataplane.request import Request


@dataclass(frozen=True)
class SwapCosts:
    """The cost model of `auto`, in tokens' worth of recompute: moving one token's KV one way
    between the pools costs about a quarter of recomputing it (a PCIe copy against a prefill's
    matmuls), and each swap pays a fixed overhead (the transfers' set-up, a step's worth of
    bookkeeping) that makes recomputing a victim of a few tokens the cheaper choice. Tests and
    benchmarks move the balance."""

    per_token: float = 0.25
    overhead_tokens: float = 8.0


DEFAULT_SWAP_COSTS = SwapCosts()


class PreemptionPolicy:
    """Swap or recompute, per victim; reads the KV cache, changes nothing."""

    def __init__(self, mode: str, kv_cache: KVCacheManager, costs: SwapCosts) -> None:
        # (Without a host pool nothing fits in it: "swap" then recomputes; the engine refuses
        # that configuration where it plans the pools.)
        self.mode = mode
        self.kv_cache = kv_cache
        self.costs = costs

    def recompute_cost(self, request: Request) -> float:
        """Tokens a recompute of the running `request` would compute again: its computed
        tokens less the leading blocks another request keeps in the prefix cache."""
        shared = self.kv_cache.num_shared_prefix_blocks(request)
        return float(max(0, request.num_computed_tokens - shared * self.kv_cache.block_size))

    def swap_cost(self, request: Request) -> float:
        """A swap of the running `request`, in tokens' worth of recompute: the fixed overhead
        plus its blocks moved out and back in, less the shared ones the swap-in finds cached."""
        blocks = len(request.block_table)
        moved = 2 * blocks - self.kv_cache.num_shared_prefix_blocks(request)
        return self.costs.overhead_tokens + moved * self.kv_cache.block_size * self.costs.per_token

    def by_swap(self, request: Request) -> bool:
        """Whether preempting the running `request` now would swap it (else recompute)."""
        if self.mode == "recompute" or not request.block_table:
            return False
        if len(request.block_table) > self.kv_cache.num_free_host_blocks:
            return False  # the host pool is full: recompute rather than fail
        if self.mode == "swap":
            return True
        return self.swap_cost(request) < self.recompute_cost(request)
