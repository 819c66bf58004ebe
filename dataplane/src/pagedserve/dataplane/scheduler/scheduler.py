"""Continuous batching over the paged KV cache. Imports no torch.

Each step every request's computed tokens catch up towards its total tokens, within a
token budget: a whole prompt, a chunk of one, one decode token or a recompute after
preemption are the same operation. Running requests go first (oldest first); then
swapped-out ones resume, then waiting ones join, first come first served, while blocks,
the budget and `max_num_seqs` allow. Resuming and admitting keep a watermark of the device
blocks free (unless nothing runs), so that they do not cause a preemption the next step.

When a running request cannot get a block, the most recently admitted running request is
preempted, until the request fits (possibly by preempting itself when it is the newest):

- by swap: its blocks are copied to the host pool, its progress kept; it waits in the
  swapped queue and is copied back in before it runs again, ahead of any waiting request;
- by recompute: its blocks are freed and it waits at the head of the waiting queue; it
  recomputes its tokens, less the leading blocks the prefix cache still holds.

Which of the two is chosen per victim: preemption.py. Without a host pool every preemption
recomputes. Nothing is resumed or admitted in a step
that preempted, so a step's swap-outs and swap-ins never meet.

The scheduler moves no data: each SchedulerOutput lists the block copies of its swap-outs
(device -> host) and swap-ins (host -> device), which the engine must make, swap-outs
first, before the step's forward and before the next `schedule()`.

A request joining the batch (new, or resumed after preemption) first takes the cached
blocks that start its tokens and computes only the rest; the blocks each step fills are
cached when the step's output comes back, once their KV is written.

Priorities (dataplane/src/pagedserve/dataplane/scheduler/priority.py): with requests of different `priority`, the
running list and both queues are ordered by effective priority (lower first, aging included)
before each step, so the victims above come from the worst end, a waiting request of a
strictly better priority joins ahead of swapped-out work, and the next request to join may
preempt running ones of a strictly worse priority (a priority preemption, counted apart).
A waiting request joins in the step that preempted for it (the victims' swap-outs are copied
before the forward that writes its blocks); a swapped-out one resumes the step after, so that
swap-outs and swap-ins still never meet. All priorities equal: nothing of this applies.

Tenants (dataplane/src/pagedserve/dataplane/scheduler/fair_share.py): with two or more, the tenant holding least joins
next and may preempt one over its share (counted apart). One tenant: nothing of this applies.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from pagedserve.common import admission_rules
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import KVCacheManager
from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.scheduler.drafts import drafts_to_verify
from pagedserve.dataplane.scheduler.fair_share import Shares, several_tenants
from pagedserve.dataplane.scheduler.integrity import check_integrity
from pagedserve.dataplane.scheduler.output import ScheduledRequest, SchedulerOutput
from pagedserve.dataplane.scheduler.preemption import DEFAULT_SWAP_COSTS, PreemptionPolicy, SwapCosts
from pagedserve.dataplane.scheduler.priority import (
    PRIORITY_AGING_S,
    Priorities,
    blocks_to_join,
    dequeue,
    enqueue,
    mixed,
    sole_blocks,
)
from pagedserve.dataplane.scheduler.step_budget import MixedStepBudget, decodes_next, urgent_prompt_tokens
from pagedserve.dataplane.scheduler.stopping import append_until_stop, stop_reason


class Scheduler:
    """Plans each step from `config` (SchedulerConfig, validated there: batch and token
    budgets, prompt-token bounds, preemption mode, watermark); `max_model_len` is the context
    limit the engine resolved. Swapping needs the KV cache manager's host pool. `swap_costs`:
    the preemption cost model (preemption.py); `priority_aging_s`: seconds of queueing per
    step of aging (0: none); `clock` reads the time aging counts (tests pass their own).
    `mixed_step_budget`: prompt tokens a step may take while others decode, learned from the
    engine's step times (step_budget.py; by default from `config.prefill_stretch`; the
    smaller of it and the fixed bound applies)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        config: SchedulerConfig,
        max_model_len: int,
        *,
        swap_costs: SwapCosts = DEFAULT_SWAP_COSTS,
        priority_aging_s: float = PRIORITY_AGING_S,
        mixed_step_budget: MixedStepBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        Priorities(priority_aging_s, 0.0)  # (checks it)
        self.preemption = PreemptionPolicy(config.preemption_mode, kv_cache, swap_costs)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        if mixed_step_budget is None and config.prefill_stretch:
            mixed_step_budget = MixedStepBudget(config.prefill_stretch)
        self.mixed_step_budget = mixed_step_budget
        self.watermark_blocks = math.ceil(config.watermark * kv_cache.num_total_blocks)
        self.priority_aging_s = priority_aging_s
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Cumulative counters (EngineStats).
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_priority_preemptions = 0  # (also counted in num_preemptions and by mode)
        self.num_fair_share_preemptions = 0  # (likewise)

    # -- submission --------------------------------------------------------------------------
    def max_total_tokens(self, request: Request) -> int:
        """Tokens the request can ever hold: prompt plus max_tokens, capped at max_model_len."""
        return admission_rules.max_total_tokens(
            request.num_prompt_tokens, request.sampling_params.max_tokens, self.max_model_len
        )

    def room(self, request: Request) -> int:
        """Tokens `request` may still append before max_tokens or max_model_len ends it."""
        return self.max_total_tokens(request) - request.num_tokens

    def add_request(self, request: Request) -> None:
        """Queue `request`, or raise ValueError when it can never run (so it cannot hang)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        refused = admission_rules.refusal(
            request.num_prompt_tokens,
            request.sampling_params.max_tokens,
            self.kv_cache.block_size,
            self.kv_cache.num_total_blocks,
            self.max_model_len,
            prompt_only=request.pooling is not None,
        )
        if refused is not None:
            raise ValueError(refused)
        request.status = RequestStatus.WAITING
        enqueue(request, self.clock())
        self.waiting.append(request)
        self.requests[request.request_id] = request

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The step's plan: running requests first (in queue order, preempting the most
        recently admitted when blocks run out), then swapped-out and waiting ones join."""
        out = SchedulerOutput()
        now = self.clock()
        ranks = Priorities(self.priority_aging_s, now) if mixed(self.requests.values()) else None
        if ranks is not None:
            for queue in (self.running, self.swapped, self.waiting):
                ranks.order(queue)
        budget, prefill = self._schedule_running(out, now, ranks)
        # Resuming or admitting right after a preemption would only evict someone again next
        # step (and keeps a step's swap-outs and swap-ins apart).
        if not out.preempted:
            self._join(out, min(budget, prefill), now, ranks)
        return out

    def _schedule_running(
        self, out: SchedulerOutput, now: float, ranks: Priorities | None
    ) -> tuple[int, int]:
        """Give each running request its next tokens while the budget lasts; returns the
        token budget and the prompt-token bound left for joining requests."""
        budget = self.max_num_batched_tokens
        prefill = self._prefill_bound(budget, ranks)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.compute_end - request.num_computed_tokens, budget)
            decoding = decodes_next(request)
            if not decoding:
                num_new = min(num_new, prefill)
                if num_new == 0:
                    i += 1  # a prompt chunk past this step's bound: it goes on next step
                    continue
            later = len(self.running) - i - 1
            drafts = (
                drafts_to_verify(self.kv_cache, request, num_new, budget - later, len(self.running))
                if decoding
                else []
            )
            if drafts:
                num_new += len(drafts)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim, out, now)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            budget -= num_new
            if not decoding:
                prefill -= num_new
            i += 1
        return budget, prefill

    def _prefill_bound(self, budget: int, ranks: Priorities | None) -> int:
        """Prompt tokens this step may compute: bounded while requests decode (their next
        token waits for the whole step; dataplane/src/pagedserve/dataplane/scheduler/step_budget.py), so a burst of
        prompts prefills over several steps, unless they outrank every decoding request."""
        bounds = [self.max_prefill_tokens_while_decoding]
        if self.mixed_step_budget is not None:
            bounds.append(self.mixed_step_budget.tokens())
        bound = min((b for b in bounds if b is not None), default=None)
        if bound is None or not any(decodes_next(r) for r in self.running):
            return budget
        if ranks is not None:
            bound += urgent_prompt_tokens((self.running, self.swapped, self.waiting), self.running, ranks)
        return min(bound, budget)

    def _join(self, out: SchedulerOutput, budget: int, now: float, ranks: Priorities | None) -> None:
        """Resume swapped-out requests, then admit waiting ones (new, or recomputing), in queue
        order, while blocks, the budget and `max_num_seqs` allow; the first that cannot join
        stops the rest (so smaller ones behind cannot starve it). With priorities it may
        preempt worse-priority running requests (`_preempt_for`), and nothing else joins; with
        tenants, those of a tenant over its share (`_preempt_for_share`), and joining goes on."""
        shares = Shares(self.running) if several_tenants(self.requests.values()) else None
        while budget > 0:
            request = (
                self._next_to_join(ranks)
                if shares is None
                else shares.next_to_join(self.swapped, self.waiting, ranks)
            )
            if request is None or (
                out.preempted and (request.status is RequestStatus.SWAPPED or request in out.preempted)
            ):
                return  # (a step's swap-outs and swap-ins never meet; no victim rejoins at once)
            joined = (
                self._join_one(request, budget, now, out) if len(self.running) < self.max_num_seqs else None
            )
            if joined is None:
                if ranks is not None and self._preempt_for(request, budget, now, ranks, out):
                    return
                if shares is None:
                    return
                joined = self._preempt_for_share(request, budget, now, shares, out)
                if joined is None:
                    return
            elif shares is not None:
                shares.joined(request)
            budget -= joined

    def _next_to_join(self, ranks: Priorities | None) -> Request | None:
        """The head of the swapped queue (swapped-out work resumes first: it holds host blocks
        and its progress), unless the waiting head has a strictly better effective priority."""
        if self.swapped:
            head = self.swapped[0]
            if (
                self.waiting
                and ranks is not None
                and ranks.effective(self.waiting[0]) < ranks.effective(head)
            ):
                return self.waiting[0]
            return head
        return self.waiting[0] if self.waiting else None

    def _join_one(self, request: Request, budget: int, now: float, out: SchedulerOutput) -> int | None:
        """Swap `request` in or admit it, scheduling up to `budget` of its tokens; the tokens
        scheduled, or None, changing nothing, when the device pool cannot spare its blocks."""
        if request.status is RequestStatus.SWAPPED:
            num_new = min(request.compute_end - request.num_computed_tokens, budget)
            pairs = self.kv_cache.swap_in(request, num_new, reserve=self._reserve())
            if pairs is None:
                return None
            _take(self.swapped, request)
            out.swapped_in.append(request)
            out.swap_in.extend(pairs)
            self.num_blocks_swapped_in += len(pairs)
        else:
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.compute_end - num_hit_tokens, budget)
            allocated = self.kv_cache.allocate_slots(
                request, num_new, new_computed_blocks=hit_blocks, reserve=self._reserve()
            )
            if allocated is None:
                return None
            _take(self.waiting, request)
        dequeue(request, now)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))
        return num_new

    def _reserve(self) -> int:
        """Free device blocks an admission or a resume must leave: the watermark, unless
        nothing runs (then nothing could be preempted, and a request that fits alone must)."""
        return self.watermark_blocks if self.running else 0

    # -- preemption --------------------------------------------------------------------------
    def _preempt(self, request: Request, out: SchedulerOutput, now: float) -> None:
        pairs = self.kv_cache.swap_out(request) if self.preemption.by_swap(request) else None
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        enqueue(request, now)
        if pairs is not None:
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            out.swapped_out.append(request)
            out.swap_out.extend(pairs)
            self.num_swap_preemptions += 1
            self.num_blocks_swapped_out += len(pairs)
            return
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.num_recompute_preemptions += 1
        self.waiting.appendleft(request)

    def _preempt_for(
        self, request: Request, budget: int, now: float, ranks: Priorities, out: SchedulerOutput
    ) -> bool:
        """`request`, next to join, lacks blocks or a batch slot: preempt the running requests
        it outranks, worst effective priority first (the most recently admitted among equals),
        until it fits; then a waiting one joins in this step, a swapped-out one in the next.
        Nothing is preempted when even all of them would not make room: evicting then would
        slow them down for nobody. Whether anything was preempted."""
        victims = ranks.victims(request, self.running)
        if not victims:
            return False
        freed = sum(sole_blocks(self.kv_cache, v) for v in victims)
        reserve = self.watermark_blocks if len(victims) < len(self.running) else 0
        if (
            self.kv_cache.pool.num_free_blocks + freed
            < blocks_to_join(self.kv_cache, request, budget) + reserve
        ):
            return False
        for victim in victims:
            self._unschedule(victim, out)
            self.running.remove(victim)
            self._preempt(victim, out, now)
            self.num_priority_preemptions += 1
            if len(self.running) >= self.max_num_seqs:
                continue
            if request.status is RequestStatus.SWAPPED:
                if (
                    blocks_to_join(self.kv_cache, request, budget) + self._reserve()
                    <= self.kv_cache.pool.num_free_blocks
                ):
                    return True
            elif self._join_one(request, budget, now, out) is not None:
                return True
        return True

    def _preempt_for_share(
        self, request: Request, budget: int, now: float, shares: Shares, out: SchedulerOutput
    ) -> int | None:
        """`request`, next to join, lacks blocks or a batch slot: preempt running requests of
        tenants over their share (`Shares.victims`) until it fits, and admit it if it waits;
        the tokens it was scheduled, or None (a swapped-out one resumes next step, its blocks
        now free). Nothing is preempted unless the victims make room for it."""
        needed = blocks_to_join(self.kv_cache, request, budget)
        chosen: list[Request] = []
        freed = 0
        for victim in shares.victims(request, self.running):
            chosen.append(victim)
            freed += sole_blocks(self.kv_cache, victim)
            reserve = self.watermark_blocks if len(chosen) < len(self.running) else 0
            if (
                len(self.running) - len(chosen) < self.max_num_seqs
                and self.kv_cache.pool.num_free_blocks + freed >= needed + reserve
            ):
                break
        else:
            return None
        for victim in chosen:
            self._unschedule(victim, out)
            self.running.remove(victim)
            shares.left(victim)
            self._preempt(victim, out, now)
            self.num_fair_share_preemptions += 1
        if request.status is RequestStatus.SWAPPED:
            return None
        joined = self._join_one(request, budget, now, out)
        if joined is not None:
            shares.joined(request)
        return joined

    def _unschedule(self, request: Request, out: SchedulerOutput) -> None:
        """Take the running `request` out of this step's plan, if it is in it, and give back
        the blocks allocated for the step's tokens: they will never be written, and a swap
        moves only the blocks of its computed tokens. (Its tokens stay off the budget: the
        step then simply batches fewer.)"""
        for i, item in enumerate(out.scheduled):
            if item.request is request:
                del out.scheduled[i]
                self.kv_cache.trim(request, request.num_computed_tokens)
                return

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        accepted: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, and retire finished requests.

        `sampled` maps request id to the token drawn for each scheduled request whose
        `samples` was true; `accepted`, to the drafted tokens a speculative step accepted
        before it (a prefix of its `spec_token_ids`). The rejected drafts' KV slots are
        given back (a block left empty returns to the pool) and only accepted tokens count as
        computed, so prefix-cache hashes never cover a rejected token. A stop inside an
        accepted run ends the request there. Returns the requests that finished this step
        (blocks freed).
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            token = sampled.get(request.request_id)
            run = [*(accepted or {}).get(request.request_id, ()), *(() if token is None else (token,))]
            rejected = len(item.spec_token_ids) - max(0, len(run) - 1)
            request.num_computed_tokens += item.num_new_tokens - rejected
            if rejected:
                self.kv_cache.trim(request, request.num_computed_tokens)
            if request.first_chunk_end is not None and request.num_computed_tokens >= request.first_chunk_end:
                request.first_chunk_end = None  # its prompt is computed: from here on as any sample
            if not run:
                self.kv_cache.cache_blocks(request, request.num_computed_tokens)
                if request.pooling is not None and request.num_computed_tokens == request.num_tokens:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)  # its prompt is pooled
                    finished.append(request)
                continue
            if request.num_computed_tokens != request.num_tokens + len(run) - 1:
                raise RuntimeError(f"token sampled for {request} before its computed tokens caught up")
            reason = append_until_stop(request, run, self.max_model_len)
            self.kv_cache.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def stop_reason(self, request: Request, token: int) -> RequestStatus | None:
        """Why `request` ends with `token` just appended, or None if it goes on."""
        return stop_reason(request, token, self.max_model_len)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = status
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    # -- introspection -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_integrity(self) -> None:
        """Assert the queues, the block tables and both pools agree (tests call it every step)."""
        check_integrity(self)


def _take(queue: deque[Request], request: Request) -> None:
    """Remove `request` from `queue`: its head, unless a preemption put a victim before it."""
    if queue[0] is request:
        queue.popleft()
    else:
        queue.remove(request)
