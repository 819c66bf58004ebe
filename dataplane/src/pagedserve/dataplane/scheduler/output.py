"""One scheduler step's plan: the requests it computes and how many tokens each, its
preemptions and the swap copies the engine makes before the forward. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.dataplane.request import Request


@dataclass
class ScheduledRequest:
    """`num_new_tokens` of `request` computed this step; with `spec_token_ids` (speculative
    decoding) the last of them are those drafted tokens, after its last known token."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so a new one is sampled
        (never for a pooling request: it ends with its prompt, nothing sampled)."""
        r = self.request
        return r.pooling is None and r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(
            self.spec_token_ids
        )


@dataclass
class SchedulerOutput:
    """One step's plan. `preempted` lists every victim in preemption order, `swapped_out` those
    of them preempted by swap; `swapped_in` the requests resumed from the host pool (also in
    `scheduled`). `swap_out` holds (device block, host block) and `swap_in` (host block,
    device block) copies, to be made swap-outs first, before the step's forward."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
