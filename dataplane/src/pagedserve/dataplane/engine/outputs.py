"""What the engine hands its callers each step, and its stats: plain data, no torch, so the
data-plane server imports them without loading the model code."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.dataplane.kvcache import PrefixCacheStats
from pagedserve.dataplane.request import Request


@dataclass
class StepResult:
    """What one step produced: new tokens per request (several after a drafted run was
    accepted) and the requests that finished.
    `faulted`: requests whose own work in the step raised (engine id -> the error), aborted
    with their samples and blocks freed; the rest of the batch went on without them."""

    new_tokens: dict[str, list[int]]
    finished: list[Request]
    num_batched_tokens: int
    num_preempted: int
    faulted: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """The pool, the scheduler and the prefix cache in numbers: what the server reports per
    step and what Prometheus scrapes, read without reaching into the engine's parts."""

    total_blocks: int
    free_blocks: int  # allocation can take them: free plus evictable cached
    cached_blocks: int  # carrying a prefix-cache hash, referenced or not
    token_usage: float  # fraction of the pool's token slots holding computed tokens
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative, both modes
    prefix_cache: PrefixCacheStats  # a copy: later admissions do not change it
    # Preemption by swap and the host (swap) pool; zero where there is no host pool.
    num_swapped: int = 0  # requests swapped out now
    num_preemptions_swap: int = 0  # cumulative, by mode
    num_preemptions_recompute: int = 0
    blocks_swapped_out: int = 0  # cumulative: device -> host block copies
    blocks_swapped_in: int = 0  # cumulative: host -> device block copies
    swap_seconds: float = 0.0  # cumulative wall time spent copying swapped blocks
    host_total_blocks: int = 0
    host_free_blocks: int = 0
    # Speculative decoding, cumulative: drafted runs verified, their tokens, those accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return (self.total_blocks - self.free_blocks) / self.total_blocks

    @property
    def host_usage(self) -> float:
        """Fraction of the host pool's blocks holding swapped-out KV, in [0, 1] (0 without one)."""
        if not self.host_total_blocks:
            return 0.0
        return (self.host_total_blocks - self.host_free_blocks) / self.host_total_blocks


def sample_request_id(request_id: str, index: int) -> str:
    """The request id of sample `index` of request `request_id`: the request's own for sample 0.

    The only place sample ids are made; callers map them from their own keys and never parse one.
    """
    return request_id if index == 0 else f"{request_id}#{index}"
