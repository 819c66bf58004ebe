"""How many of a decoding request's drafted tokens (speculative decoding) a step verifies.
Imports no torch."""

from __future__ import annotations

from pagedserve.dataplane.kvcache import KVCacheManager
from pagedserve.dataplane.request import Request


def drafts_to_verify(
    kv_cache: KVCacheManager, request: Request, num_new: int, spare: int, num_running: int
) -> list[int]:
    """The drafted tokens `request` verifies this step besides its `num_new` own: as many of
    its `spec_token_ids` as `spare` tokens of the step's budget hold (the scheduler leaves a
    token for each running request after it), and none when their KV slots would take a block
    the pool cannot spare while keeping one free for each of the `num_running` requests. So a
    draft never causes a preemption, nor takes a later request's token."""
    drafts = request.spec_token_ids[: max(0, spare - num_new)]
    if not drafts:
        return []
    own = kv_cache.num_blocks_for(request.num_computed_tokens + num_new)
    extra = kv_cache.num_blocks_for(request.num_computed_tokens + num_new + len(drafts)) - own
    if extra and extra + num_running > kv_cache.pool.num_free_blocks:
        return []
    return drafts
