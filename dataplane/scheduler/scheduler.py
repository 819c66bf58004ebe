"""Continuous batching over the paged KV cache. Imports no torch.

Each step every request's computed tokens catch up towards its total tokens, within a
token budget: a whole prompt, a chunk of one, one decode token or a recompute after
preemption are the same operation. Running requests go first (oldest first); waiting
ones join, first come first served, while blocks, the budget and `max_num_seqs` allow.
When a running request cannot get a block, the most recently admitted running request
is preempted by recompute: its blocks are freed and it waits at the head of the queue.

A request joining the batch (new, or resumed after preemption) first takes the cached
blocks that start its tokens and computes only the rest; the blocks each step fills are
cached when the step's output comes back, once their KV is written.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from dataplane.kvcache import KVCacheManager
from dataplane.request import Request, RequestStatus
from pagedserve.common import admission_rules


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so a new one is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, kv_cache: KVCacheManager, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- submission --------------------------------------------------------------------------
    def max_total_tokens(self, request: Request) -> int:
        """Tokens the request can ever hold: prompt plus max_tokens, capped at max_model_len."""
        return admission_rules.max_total_tokens(
            request.num_prompt_tokens, request.sampling_params.max_tokens, self.max_model_len
        )

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
        )
        if refused is not None:
            raise ValueError(refused)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1

        # Admitting right after a preemption would only evict someone again next step.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, new_computed_blocks=hit_blocks) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, and retire finished requests.

        `sampled` maps request id to the token drawn for each scheduled request whose
        `samples` was true. Returns the requests that finished this step (blocks freed).
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.num_computed_tokens != request.num_tokens:
                raise RuntimeError(f"token sampled for {request} before its computed tokens caught up")
            request.append_output_token(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _stop_reason(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

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

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        pool = self.kv_cache.pool
        holders = Counter(b for r in [*self.running, *self.waiting] for b in r.block_table)
        assert len(holders) == pool.num_used_blocks, (
            f"requests hold {len(holders)} blocks but the pool has {pool.num_used_blocks} in use"
        )
        for block_id, n in holders.items():
            assert pool.blocks[block_id].ref_cnt == n, f"{pool.blocks[block_id]} is in {n} block tables"
        for r in self.waiting:
            assert not r.block_table and r.num_computed_tokens == 0, f"waiting {r} holds blocks"
        assert len(self.running) <= self.max_num_seqs
