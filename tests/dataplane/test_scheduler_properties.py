"""Property tests: random submit / step / abort interleavings against a model-free scheduler.

After every operation the scheduler's integrity holds; every step respects the token budget
and max_num_seqs, is never empty while work remains, and allocates exactly the blocks its
tokens need; preemption picks the most recently admitted requests and keeps their tokens;
draining finishes everything within a bound of steps, and then every block is free.

Prompts are drawn from a few shared prefixes with random tails and salts, so prefix-cache
hits, shared blocks and evictions mix in. The shadow KV (scheduler_harness.py) catches a wrong
hit, a cross-salt hit or a write into a shared or cached block. Replaying the KV events into a
set must reproduce the pool's cached hashes after every operation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings, target
from hypothesis import strategies as st

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import (
    AllBlocksCleared,
    BlockHash,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    cdiv,
)
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from pagedserve.dataplane.scheduler.step_budget import MixedStepBudget
from tests.dataplane.scheduler_harness import (
    EOS,
    VOCAB,
    ResetPrefixCache,
    ShadowKV,
    event,
    shared_prefix_prompt,
)

STOP = 5


@dataclass(frozen=True)
class Config:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    special_rate: float = 0.25  # chance a sampled token is EOS or STOP
    enable_prefix_caching: bool = True
    max_prefill_tokens_while_decoding: int | None = None
    bound_by_budget: bool = False  # the bound comes as a mixed-step budget, not the fixed count


class FixedBudget(MixedStepBudget):
    """A mixed-step budget that always answers the same count (the scheduler alone times nothing)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(1.0)
        self.fixed = tokens

    def tokens(self) -> int | None:
        return self.fixed


@dataclass(frozen=True)
class Submit:
    prompt_len: int
    max_tokens: int
    eos: bool
    ignore_eos: bool
    stop: bool
    reuse_id: int | None  # index of an earlier submission whose id to reuse
    family: int = 0  # which shared prefix the prompt starts with
    diverge_at: int | None = None  # from here on the prompt takes tokens from a small random tail
    tail_seed: int = 0
    salt: str | None = None
    tenant: str = ""  # two or more present: the scheduler shares the batch between them

    def prompt(self) -> list[int]:
        return shared_prefix_prompt(self.prompt_len, self.family, self.diverge_at, self.tail_seed)


@dataclass(frozen=True)
class StepOp:
    seed: int


@dataclass(frozen=True)
class Abort:
    index: int


Op = Submit | StepOp | Abort | ResetPrefixCache


class Harness(ShadowKV):
    """Drives a Scheduler and checks it against what the spec says must happen."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        pool = BlockPool(cfg.num_blocks, enable_kv_events=cfg.enable_prefix_caching)
        kv = KVCacheManager(pool, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        bound, by_budget = cfg.max_prefill_tokens_while_decoding, cfg.bound_by_budget
        config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            watermark=0.0,
            max_prefill_tokens_while_decoding=None if by_budget else bound,
        )
        scheduler = Scheduler(
            kv,
            config,
            cfg.max_model_len,
            mixed_step_budget=FixedBudget(bound) if by_budget and bound is not None else None,
        )
        super().__init__(cfg.block_size, pool, kv, scheduler)
        # What an external index following the KV events believes the pool holds.
        self.index: set[BlockHash] = set()
        self.last_seq = 0
        self.cleared: set[BlockHash] = set()
        self.num_hit_tokens = 0
        self.num_shared = 0  # shared blocks seen at checks, summed
        self.num_fair_share_preemptions = 0

    # -- operations --------------------------------------------------------------------------
    def submit(self, op: Submit) -> None:
        cfg = self.cfg
        if op.reuse_id is not None and self.submitted:
            rid = self.submitted[op.reuse_id % len(self.submitted)].request_id
        else:
            rid = f"r{len(self.submitted)}"
        params = SamplingParams(
            max_tokens=op.max_tokens, ignore_eos=op.ignore_eos, stop_token_ids=(STOP,) if op.stop else ()
        )
        request = Request(rid, op.prompt(), params, EOS if op.eos else None, cache_salt=op.salt)
        request.tenant = op.tenant
        total = min(op.prompt_len + op.max_tokens, cfg.max_model_len)
        if rid in self.s.requests:
            refusal: str | None = "already in use"
        elif op.prompt_len >= cfg.max_model_len:
            refusal = "max_model_len"
        elif cdiv(total, cfg.block_size) > cfg.num_blocks:
            refusal = "KV blocks"
        else:
            refusal = None

        before = (list(self.s.waiting), dict(self.s.requests))
        try:
            self.s.add_request(request)
        except ValueError as e:
            assert refusal is not None, f"refused a request that fits: {e}"
            assert refusal in str(e)
            assert (list(self.s.waiting), dict(self.s.requests)) == before
        else:
            assert refusal is None, f"accepted a request that must be refused ({refusal})"
            assert self.s.max_total_tokens(request) == total
            assert list(self.s.waiting)[-1] is request
            self.submitted.append(request)
            self.outputs[id(request)] = []
        self.s.check_integrity()
        self.follow_events()

    def abort(self, op: Abort) -> None:
        if not self.submitted:
            return
        # By id: an id may name a finished request and, later, a live one that reused it.
        rid = self.submitted[op.index % len(self.submitted)].request_id
        live = self.s.requests.get(rid)
        request = live if live is not None else self.submitted[op.index % len(self.submitted)]
        released = sum(1 for b in request.block_table if self.pool.blocks[b].ref_cnt == 1)
        free_before = self.pool.num_free_blocks
        status_before = request.status
        got = self.s.abort(rid)
        if live is not None:
            assert got is request
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.block_table == []
            assert self.pool.num_free_blocks == free_before + released  # shared blocks stay held
            assert request not in self.s.running and request not in self.s.waiting
        else:
            assert got is None
            assert request.status is status_before
        self.s.check_integrity()
        self.follow_events()

    def reset_prefix_cache(self) -> None:
        referenced_before = [b.ref_cnt for b in self.pool.blocks]
        free_before = self.pool.free_queue.block_ids()
        self.kv.reset_prefix_cache()
        assert self.pool.cached_block_hashes() == set()
        assert all(b.block_hash is None for b in self.pool.blocks)
        assert [b.ref_cnt for b in self.pool.blocks] == referenced_before
        assert self.pool.free_queue.block_ids() == free_before
        self.s.check_integrity()
        self.follow_events()

    def step(self, op: StepOp) -> list[Request]:
        cfg, s = self.cfg, self.s
        rng = random.Random(op.seed)
        had_work = s.has_unfinished()
        prev_running = list(s.running)
        prev_tables = {id(r): list(r.block_table) for r in s.running}

        prev_waiting = list(s.waiting)
        stats_before = (self.kv.prefix_cache_stats.requests, self.kv.prefix_cache_stats.preempted_requests)
        out = s.schedule()
        self.num_steps += 1
        self.check_schedule(out, had_work, prev_running, prev_tables)
        self.check_admissions(out, prev_waiting, stats_before)
        self.check_and_write_kv(out, prev_waiting)

        sampled: dict[str, int] = {}
        expect_finished: list[tuple[Request, str]] = []
        for item in out.scheduled:
            if not item.samples:
                continue
            r = item.request
            if rng.random() < cfg.special_rate:
                token = rng.choice((EOS, STOP))
            else:
                token = rng.choice([t for t in range(VOCAB) if t not in (EOS, STOP)])
            sampled[r.request_id] = token
            self.outputs[id(r)].append(token)
            reason = self.expected_stop(r, token)
            if reason is not None:
                expect_finished.append((r, reason))
        finished = s.update_from_output(out, sampled)
        assert [(r, r.finish_reason) for r in finished] == expect_finished
        for r in finished:
            assert r.block_table == []
            assert r.request_id not in s.requests
        self.check_state()
        self.follow_events()
        return finished

    # -- checks ------------------------------------------------------------------------------
    def expected_stop(self, r: Request, token: int) -> str | None:
        p = r.sampling_params
        num_output = len(self.outputs[id(r)])
        if not p.ignore_eos and r.eos_token_id is not None and token == r.eos_token_id:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if num_output >= p.max_tokens or r.num_prompt_tokens + num_output >= self.cfg.max_model_len:
            return "length"
        return None

    def check_schedule(
        self,
        out: SchedulerOutput,
        had_work: bool,
        prev_running: list[Request],
        prev_tables: dict[int, list[int]],
    ) -> None:
        cfg, s = self.cfg, self.s
        scheduled = [x.request for x in out.scheduled]
        self.check_step_shape(out, had_work, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        # Scheduled requests are the front of the running list: oldest first, admissions last;
        # with prompt tokens bounded while requests decode, less the prompt chunks past it.
        bound = cfg.max_prefill_tokens_while_decoding
        if bound is None:
            assert scheduled == s.running[: len(scheduled)]
        else:
            assert scheduled == [r for r in s.running if r in scheduled]
            # Running ones decoding their next token (checked before the step updates them; a
            # request admitted now may look so after a prefix-cache hit, but no bound is set
            # by those).
            decoding = [
                x
                for x in out.scheduled
                if x.request in prev_running
                and x.num_new_tokens == 1
                and x.request.num_computed_tokens >= x.request.num_prompt_tokens
            ]
            if decoding:
                prompt_tokens = sum(x.num_new_tokens for x in out.scheduled if x not in decoding)
                assert prompt_tokens <= bound
                event("prompt tokens bounded while decoding")
            if len(scheduled) < len(s.running):
                event("a prompt chunk waited for the bound")

        n = len(out.preempted)
        fair = s.num_fair_share_preemptions - self.num_fair_share_preemptions
        self.num_fair_share_preemptions = s.num_fair_share_preemptions
        if fair:
            # For a request of a tenant holding less: victims of other tenants, each waiting at
            # the head of the queue with nothing computed, and none of their tenants joined.
            event("fair-share preemption")
            assert fair == n
            joined = [r for r in scheduled if r not in prev_running]
            assert joined and not {r.tenant for r in out.preempted} & {r.tenant for r in joined}
            assert set(map(id, list(s.waiting)[:n])) == set(map(id, out.preempted))
            for r in out.preempted:
                assert r in prev_running and r not in scheduled
                assert (
                    r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.block_table == []
                )
        elif n:
            event("preempted")
            # Victims are the most recently admitted running requests, newest first ...
            assert out.preempted == prev_running[::-1][:n]
            # ... and wait at the head of the queue in their admission order.
            assert list(s.waiting)[:n] == out.preempted[::-1]
            for r in out.preempted:
                assert r.status is RequestStatus.WAITING
                assert r.num_computed_tokens == 0
                assert r.block_table == []
            # No admission in a step that had to preempt.
            assert all(r in prev_running for r in scheduled)
        # Block tables are append-only while held.
        for r in s.running:
            if id(r) in prev_tables:
                old = prev_tables[id(r)]
                assert r.block_table[: len(old)] == old
        self.check_blocks()
        s.check_integrity()

    def check_blocks(self) -> None:
        positions: dict[int, set[int]] = {}
        for r in self.s.running:
            assert len(r.block_table) == len(set(r.block_table)), f"{r} holds a block twice"
            for index, block_id in enumerate(r.block_table):
                positions.setdefault(block_id, set()).add(index)
        for block_id, n in self.device_holders().items():
            assert self.pool.blocks[block_id].ref_cnt == n
            if n > 1:
                event("shared block")
                self.num_shared += 1
                assert self.cfg.enable_prefix_caching, "blocks shared without prefix caching"
                # A hash chain pins a block to one logical position.
                assert len(positions[block_id]) == 1, f"block {block_id} at positions {positions[block_id]}"

    def check_and_write_kv(self, out: SchedulerOutput, prev_waiting: list[Request]) -> None:
        """What the model runner would read and write, against the shadow KV.

        A request joining the batch reads its whole computed prefix (its hits); one already
        running reads what it wrote itself, so its last computed slot is checked as a sample:
        the writes below are what keep the rest intact.
        """
        for x in out.scheduled:
            r = x.request
            first = 0 if r in prev_waiting else max(0, r.num_computed_tokens - 1)
            self.assert_holds_prefix(r, r.block_table, self.device, "device", start=first)
            self.write_kv(r, x.num_new_tokens)

    def check_admissions(
        self, out: SchedulerOutput, prev_waiting: list[Request], stats_before: tuple[int, int]
    ) -> None:
        stats = self.kv.prefix_cache_stats
        admitted = [x.request for x in out.scheduled if x.request in prev_waiting]
        first = [r for r in admitted if r.num_preemptions == 0]
        if not self.cfg.enable_prefix_caching:
            assert all(r.num_computed_tokens == 0 for r in admitted)
            assert stats == type(stats)()
            return
        assert stats.requests - stats_before[0] == len(first)
        assert stats.preempted_requests - stats_before[1] == len(admitted) - len(first)
        assert 0 <= stats.hits <= stats.queries
        for r in admitted:
            assert r.num_computed_tokens % self.cfg.block_size == 0
            assert r.num_computed_tokens < r.num_tokens  # at least one token computed for logits
            if r.num_computed_tokens:
                event("prefix-cache hit")
                self.num_hit_tokens += r.num_computed_tokens
        for r in first:
            assert r.num_cached_tokens == r.num_computed_tokens

    def follow_events(self) -> None:
        """Apply the pool's KV events to an external index; it must match the pool."""
        for record in self.pool.take_events():
            assert record.seq == self.last_seq + 1
            self.last_seq = record.seq
            e = record.event
            if isinstance(e, BlockStored):
                assert not self.index & set(e.block_hashes), "stored a hash the pool already held"
                # A parent is held by the request that stored its child, so only a reset drops it.
                assert e.parent_block_hash is None or e.parent_block_hash in self.index | self.cleared
                assert len(e.token_ids) == len(e.block_hashes) * self.cfg.block_size
                self.index.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                event("evicted")
                assert set(e.block_hashes) <= self.index
                self.index.difference_update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.cleared |= self.index
                self.index.clear()
        assert self.index == self.pool.cached_block_hashes()

    def check_state(self) -> None:
        cfg, s = self.cfg, self.s
        self.check_running(list(s.waiting))
        for r in [*s.running, *s.waiting]:
            assert r.num_output_tokens < r.sampling_params.max_tokens
            assert r.num_tokens < cfg.max_model_len
            assert s.requests[r.request_id] is r
        assert len(s.requests) == len(s.running) + len(s.waiting)
        self.check_blocks()
        s.check_integrity()

    def drain(self) -> None:
        """Step until done: within sum(max total tokens) steps, since the oldest running request
        gains at least one computed token every step and is never the one preempted."""
        bound = sum(self.s.max_total_tokens(r) for r in self.s.requests.values())
        steps = 0
        while self.s.has_unfinished():
            assert steps < bound, f"no progress after {steps} steps: {self.s.running} {self.s.waiting}"
            self.step(StepOp(seed=steps))
            steps += 1
        self.check_all_free()

    def check_all_free(self) -> None:
        super().check_all_free()
        assert self.kv.num_used_tokens == 0
        assert sorted(self.pool.free_queue.block_ids()) == list(range(self.pool.num_blocks))

    def run(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Submit):
                self.submit(op)
            elif isinstance(op, StepOp):
                self.step(op)
            elif isinstance(op, ResetPrefixCache):
                self.reset_prefix_cache()
            else:
                self.abort(op)
        self.drain()


@st.composite
def configs(draw: st.DrawFn) -> Config:
    num_blocks = draw(st.integers(1, 40))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    pool_tokens = num_blocks * block_size
    # Mostly at least the pool's size (so the pool, not max_model_len, is what runs out),
    # sometimes tight enough that max_model_len ends requests and refuses prompts.
    if draw(st.sampled_from(["roomy", "roomy", "roomy", "tight"])) == "tight":
        max_model_len = draw(st.integers(2, 16))
    else:
        max_model_len = draw(st.integers(pool_tokens, 2 * pool_tokens + 2))
    return Config(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_prefill_tokens_while_decoding=draw(st.none() | st.none() | st.integers(1, 16)),
        bound_by_budget=draw(st.booleans()),
        max_model_len=max(2, max_model_len),
        special_rate=draw(st.sampled_from([0.0, 0.05, 0.3])),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
    )


def submits_for(cfg: Config) -> st.SearchStrategy[Submit]:
    """Requests sized to the pool: most fit alone, a few do not (to exercise refusals)."""
    capacity = min(cfg.num_blocks * cfg.block_size, cfg.max_model_len)
    return st.builds(
        Submit,
        prompt_len=st.integers(1, max(1, capacity // 2)) | st.integers(1, capacity + 4),
        max_tokens=st.integers(1, max(1, min(capacity // 2, 48))) | st.integers(1, 24),
        eos=st.booleans(),
        ignore_eos=st.booleans(),
        stop=st.booleans(),
        reuse_id=st.none() | st.none() | st.integers(0, 50),
        family=st.integers(0, 1),
        diverge_at=st.none() | st.none() | st.integers(0, capacity),
        tail_seed=st.integers(0, 3),
        salt=st.none() | st.none() | st.sampled_from(["x", "y"]),
        tenant=st.sampled_from(["", "", "a", "b"]),
    )


steps = st.builds(StepOp, seed=st.integers(0, 2**16))
aborts = st.builds(Abort, index=st.integers(0, 50))
resets = st.just(ResetPrefixCache())


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Config, list[Op]]:
    cfg = draw(configs())
    submits = submits_for(cfg)
    ops = draw(
        st.lists(
            st.one_of(
                submits,
                submits,
                submits,
                steps,
                steps,
                steps,
                steps,
                steps,
                steps,
                aborts,  # aborts and resets are rare
                resets,
            ),
            min_size=6,
            max_size=50,
        )
    )
    return cfg, ops


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Config, list[Submit]]:
    cfg = draw(configs())
    return cfg, draw(st.lists(submits_for(cfg), min_size=1, max_size=10))


@settings(deadline=None, max_examples=200)
@given(scenario=scenarios())
def test_random_interleavings_keep_every_invariant(scenario: tuple[Config, list[Op]]) -> None:
    cfg, ops = scenario
    harness = Harness(cfg)
    harness.run(ops)
    if harness.s.num_preemptions:
        event("run with preemption")
    # Steer generation towards the interesting parts: runs that preempt and share blocks.
    target(float(harness.s.num_preemptions), label="preemptions")
    target(float(min(harness.num_shared, 100)), label="shared blocks")  # capped: bigger only means slower


@settings(deadline=None, max_examples=100)
@given(workload=workloads())
def test_accepted_requests_all_finish_without_deadlock(workload: tuple[Config, list[Submit]]) -> None:
    """Liveness: submit everything up front, then only step; all accepted requests finish."""
    cfg, requests = workload
    harness = Harness(cfg)
    for op in requests:
        harness.submit(op)
    harness.drain()
    for r in harness.submitted:
        assert r.finish_reason in ("stop", "length")
    target(float(harness.s.num_preemptions), label="preemptions")


def test_crafted_run_forces_preemption() -> None:
    """Six small blocks, four growing requests: the harness sees preemptions and every check holds."""
    cfg = Config(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    harness = Harness(cfg)
    ops: list[Op] = [Submit(3, 6, eos=False, ignore_eos=False, stop=False, reuse_id=None) for _ in range(4)]
    ops += [StepOp(seed=i) for i in range(3)]
    harness.run(ops)
    assert harness.s.num_preemptions > 0
    assert sum(r.num_preemptions for r in harness.submitted) == harness.s.num_preemptions
    for r in harness.submitted:
        assert r.finish_reason == "length"
        assert r.num_output_tokens == 6


def test_seeded_sweep_reaches_preemption_and_drains() -> None:
    """A deterministic sweep over small random workloads: preemption happens and nothing leaks."""
    rng = random.Random(1234)
    total_preemptions = 0
    for _ in range(60):
        cfg = Config(
            num_blocks=rng.randint(2, 12),
            block_size=rng.choice([1, 2, 4]),
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(1, 24),
            max_model_len=rng.randint(4, 48),
        )
        ops: list[Op] = []
        for _ in range(rng.randint(1, 25)):
            kind = rng.random()
            if kind < 0.35:
                ops.append(
                    Submit(rng.randint(1, 12), rng.randint(1, 12), rng.random() < 0.3, False, False, None)
                )
            elif kind < 0.9:
                ops.append(StepOp(rng.randrange(2**16)))
            else:
                ops.append(Abort(rng.randrange(50)))
        harness = Harness(cfg)
        harness.run(ops)
        total_preemptions += harness.s.num_preemptions
    assert total_preemptions > 0
