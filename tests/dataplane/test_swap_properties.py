"""Property tests of preemption by swap and by recompute, without a model.

A model-free harness drives a Scheduler over a device pool and a host (swap) pool through
random submissions (n > 1 samples included, joining as the engine lets them: once the first
sample has a token), steps, aborts (at rest, and between `schedule()` and the execution of
its block copies: during a swap-out or a swap-in), aborts of one sample of a group (as
`LLMEngine.abort_sample`: running, waiting, swapped out or not yet joined; its siblings run
on) and prefix-cache resets, in every preemption mode. The engine's part is simulated on a shadow KV of both pools: each slot
records which token prefix (and salt) its KV belongs to; a step's swap-outs, then its
swap-ins copy shadow blocks between the pools as the model runner's `swap_blocks` would,
then the step writes its new tokens. After every operation:

- both pools pass `check_integrity()` and the scheduler's own (queues, holders, counts);
- every running request's device blocks and every swapped-out request's host blocks hold
  exactly its own computed prefix (a wrong copy, a lost block, a reused host block or a
  wrong prefix hit is caught), and a step writes only into private, uncached blocks;
- a step never both swaps out and swaps in; victims are the most recently admitted; a
  swapped-out victim keeps its progress and a recomputed one starts over; the mode is obeyed;
- new arrivals are admitted only when nothing is swapped out, and (with something running)
  above the watermark;
- draining finishes every accepted request within a bound, then both pools are all free.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings, target
from hypothesis import strategies as st

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager, cdiv
from pagedserve.dataplane.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from pagedserve.dataplane.scheduler.preemption import SwapCosts
from tests.dataplane.scheduler_harness import (
    EOS,
    VOCAB,
    Content,
    ResetPrefixCache,
    ShadowKV,
    Slot,
    event,
    shared_prefix_prompt,
)


@dataclass(frozen=True)
class Config:
    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    mode: str = "auto"
    watermark: float = 0.0
    swap_overhead_tokens: float = 8.0
    swap_cost_per_token: float = 0.25
    enable_prefix_caching: bool = True
    eos_rate: float = 0.1


@dataclass(frozen=True)
class Submit:
    prompt_len: int
    max_tokens: int
    n: int = 1
    family: int = 0
    diverge_at: int | None = None
    tail_seed: int = 0
    salt: str | None = None
    eos: bool = False

    def prompt(self) -> list[int]:
        return shared_prefix_prompt(self.prompt_len, self.family, self.diverge_at, self.tail_seed)


@dataclass(frozen=True)
class StepOp:
    seed: int
    abort_swapped_out: int | None = None  # abort one of this step's swap-out victims before the copies
    abort_swapped_in: int | None = None  # abort one of this step's resumed requests before the copies


@dataclass(frozen=True)
class Abort:
    index: int
    swapped: bool = False  # pick a swapped-out request when there is one


@dataclass(frozen=True)
class AbortSample:
    """One sample of an n > 1 group, as `LLMEngine.abort_sample` does (a stop string matched)."""

    group: int
    sample: int


Op = Submit | StepOp | Abort | AbortSample | ResetPrefixCache


class Harness(ShadowKV):
    """`drain_abort_rate`: while draining, the chance a step aborts one of its swap-out victims
    or resumed requests before the copies."""

    def __init__(self, cfg: Config, drain_abort_rate: float = 0.0) -> None:
        self.cfg = cfg
        self.drain_abort_rate = drain_abort_rate
        pool = BlockPool(cfg.num_blocks)
        self.host_pool = BlockPool(cfg.num_host_blocks) if cfg.num_host_blocks else None
        kv = KVCacheManager(
            pool,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            host_pool=self.host_pool,
        )
        config = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            preemption_mode=cfg.mode,
            watermark=cfg.watermark,
        )
        costs = SwapCosts(per_token=cfg.swap_cost_per_token, overhead_tokens=cfg.swap_overhead_tokens)
        super().__init__(cfg.block_size, pool, kv, Scheduler(kv, config, cfg.max_model_len, swap_costs=costs))
        self.num_submits = 0
        self.pending_siblings: dict[int, list[Request]] = {}  # id(primary) -> siblings not yet added
        self.groups: list[list[Request]] = []  # accepted n > 1 requests, every sample
        self.num_sample_aborts = 0
        self.host: dict[Slot, Content] = {}
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_aborted_in_flight = 0
        self.num_aborted_swapping_out = 0
        self.num_aborted_swapping_in = 0
        self.num_swap_in_hits = 0

    # -- operations --------------------------------------------------------------------------
    def submit(self, op: Submit) -> None:
        cfg = self.cfg
        rid = f"r{self.num_submits}"
        self.num_submits += 1
        params = SamplingParams(max_tokens=op.max_tokens, ignore_eos=not op.eos)
        samples = [
            Request(rid if i == 0 else f"{rid}#{i}", op.prompt(), params, EOS, cache_salt=op.salt)
            for i in range(op.n)
        ]
        total = min(op.prompt_len + op.max_tokens, cfg.max_model_len)
        fits = op.prompt_len < cfg.max_model_len and cdiv(total, cfg.block_size) <= cfg.num_blocks
        primary = samples[0]
        try:
            self.s.add_request(primary)
        except ValueError:
            assert not fits, "refused a request that fits alone"
        else:
            assert fits, "accepted a request that cannot fit alone"
            for r in samples:
                self.outputs[id(r)] = []
            self.submitted.append(primary)
            if op.n > 1:
                self.pending_siblings[id(primary)] = samples[1:]
                self.groups.append(samples)
        self.check_state()

    def add_siblings(self) -> None:
        """The engine's rule: siblings join once the first sample has a token (or has ended)."""
        for primary in list(self.submitted):
            siblings = self.pending_siblings.get(id(primary))
            if siblings and (primary.num_output_tokens or primary.status.finished):
                del self.pending_siblings[id(primary)]
                if primary.status is RequestStatus.FINISHED_ABORTED:
                    continue  # the engine aborts a group's pending samples with it
                for sibling in siblings:
                    event("sibling joined")
                    self.s.add_request(sibling)
                    self.submitted.append(sibling)

    def abort(self, op: Abort) -> None:
        live = [r for r in self.submitted if not r.status.finished]
        if op.swapped and self.s.swapped:
            live = list(self.s.swapped)
        if not live:
            return
        request = live[op.index % len(live)]
        if request.status is RequestStatus.SWAPPED:
            event("abort while swapped out")
        self.abort_request(request)
        self.check_state()

    def abort_request(self, request: Request) -> None:
        host_free = self.host_pool.num_free_blocks if self.host_pool else 0
        num_host = len(request.host_block_table)
        assert self.s.abort(request.request_id) is request
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert request.block_table == [] and request.host_block_table == []
        if self.host_pool:
            assert self.host_pool.num_free_blocks == host_free + num_host
        self.pending_siblings.pop(id(request), None)

    def abort_sample(self, op: AbortSample) -> None:
        """The engine's per-sample abort: a sample not yet joined leaves the pending list; one
        the scheduler holds is aborted there, each of its device blocks losing exactly one
        reference and its host blocks all freed; the first sample's end lets its siblings join."""

        def live(group: list[Request]) -> list[Request]:
            """Samples the scheduler holds or that wait to join (a whole-group abort drops those)."""
            pending = self.pending_siblings.get(id(group[0]), [])
            return [
                r for r in group if self.s.requests.get(r.request_id) is r or any(r is p for p in pending)
            ]

        groups = [g for g in self.groups if live(g)]
        if not groups:
            return
        group = groups[op.group % len(groups)]
        samples = live(group)
        request = samples[op.sample % len(samples)]
        primary = group[0]
        pending = self.pending_siblings.get(id(primary), [])
        self.num_sample_aborts += 1
        if any(r is request for r in pending):
            event("abort a sample before it joined")
            rest = [r for r in pending if r is not request]
            if rest:
                self.pending_siblings[id(primary)] = rest
            else:
                del self.pending_siblings[id(primary)]  # (the engine drops it at the next step)
            request.status = RequestStatus.FINISHED_ABORTED
        else:
            event(f"abort a {request.status.value} sample")
            refs = {b.block_id: b.ref_cnt for b in self.pool.blocks}
            own = Counter(request.block_table)
            siblings = self.pending_siblings.pop(id(request), [])  # (abort_request drops them)
            self.abort_request(request)
            assert {b.block_id: b.ref_cnt for b in self.pool.blocks} == {
                block: n - own[block] for block, n in refs.items()
            }, "a sample's abort changed a block it does not hold"
            for sibling in siblings:
                event("a sibling joins after the first sample's abort")
                self.s.add_request(sibling)
                self.submitted.append(sibling)
        self.check_state()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        self.check_state()

    def step(self, op: StepOp) -> None:
        cfg, s = self.cfg, self.s
        rng = random.Random(op.seed)
        had_work = s.has_unfinished()
        prev_running = list(s.running)
        prev_computed = {id(r): r.num_computed_tokens for r in s.running}
        prev_waiting = list(s.waiting)
        prev_swapped = list(s.swapped)
        counts_before = (s.num_swap_preemptions, s.num_recompute_preemptions)

        out = s.schedule()
        self.num_steps += 1
        self.check_schedule(out, had_work, prev_running, prev_computed, prev_waiting, prev_swapped)
        assert (s.num_swap_preemptions, s.num_recompute_preemptions) == (
            counts_before[0] + len(out.swapped_out),
            counts_before[1] + len(out.preempted) - len(out.swapped_out),
        )
        s.check_integrity()

        # Aborts between schedule() and the copies: the engine would still run them.
        if op.abort_swapped_out is not None and out.swapped_out:
            event("abort during swap-out")
            self.num_aborted_in_flight += 1
            self.num_aborted_swapping_out += 1
            self.abort_request(out.swapped_out[op.abort_swapped_out % len(out.swapped_out)])
        if op.abort_swapped_in is not None and out.swapped_in:
            event("abort during swap-in")
            self.num_aborted_in_flight += 1
            self.num_aborted_swapping_in += 1
            self.abort_request(out.swapped_in[op.abort_swapped_in % len(out.swapped_in)])
        s.check_integrity()

        self.run_copies(out)
        self.check_and_write_kv(out, prev_running)

        sampled: dict[str, int] = {}
        for item in out.scheduled:
            r = item.request
            if not item.samples or r.status is not RequestStatus.RUNNING:
                continue
            token = EOS if rng.random() < cfg.eos_rate else rng.choice([t for t in range(VOCAB) if t != EOS])
            sampled[r.request_id] = token
            self.outputs[id(r)].append(token)
        finished = s.update_from_output(out, sampled)
        for r in finished:
            assert r.block_table == [] and r.host_block_table == []
        self.add_siblings()
        self.check_state()

    # -- the engine's part: block copies and the step's KV writes ---------------------------
    def run_copies(self, out: SchedulerOutput) -> None:
        bs = self.cfg.block_size
        for src, dst in out.swap_out:
            for offset in range(bs):
                if (src, offset) in self.device:
                    self.host[(dst, offset)] = self.device[(src, offset)]
                else:
                    self.host.pop((dst, offset), None)
        for src, dst in out.swap_in:
            for offset in range(bs):
                if (src, offset) in self.host:
                    self.device[(dst, offset)] = self.host[(src, offset)]
                else:
                    self.device.pop((dst, offset), None)

    def check_and_write_kv(self, out: SchedulerOutput, prev_running: list[Request]) -> None:
        for x in out.scheduled:
            r = x.request
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted after schedule()
            if r not in prev_running:
                # Admitted, resumed from the host pool or recomputing: its whole prefix is read.
                self.assert_holds_prefix(r, r.block_table, self.device, "device")
            self.write_kv(r, x.num_new_tokens)

    # -- checks ------------------------------------------------------------------------------
    def check_schedule(
        self,
        out: SchedulerOutput,
        had_work: bool,
        prev_running: list[Request],
        prev_computed: dict[int, int],
        prev_waiting: list[Request],
        prev_swapped: list[Request],
    ) -> None:
        cfg, s = self.cfg, self.s
        scheduled = [x.request for x in out.scheduled]
        self.check_step_shape(out, had_work, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        assert scheduled == s.running[: len(scheduled)]

        # Preemption: newest first, by the mode's rule, progress kept only by a swap.
        n = len(out.preempted)
        assert out.preempted == prev_running[::-1][:n]
        assert not (out.swap_out and out.swap_in), "a step swapped both ways"
        assert all(r in out.preempted for r in out.swapped_out)
        for r in out.preempted:
            if r in out.swapped_out:
                event("preempted by swap")
                self.num_swap_outs += 1
                assert r.status is RequestStatus.SWAPPED and r.num_computed_tokens == prev_computed[id(r)]
                assert len(r.host_block_table) == cdiv(r.num_computed_tokens, cfg.block_size)
                assert cfg.mode != "recompute"
            else:
                event("preempted by recompute")
                assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
                assert r.block_table == [] and r.host_block_table == []
                # "swap" recomputes only when the host pool could not hold the victim.
                if cfg.mode == "swap":
                    assert self.host_pool is not None
                    assert cdiv(prev_computed[id(r)], cfg.block_size) > self.host_pool.num_free_blocks
        if out.swapped_out:
            assert list(s.swapped)[: len(out.swapped_out)] == out.swapped_out[::-1]
        pairs = out.swap_out
        assert len({h for _, h in pairs}) == len(pairs), "two blocks swapped into one host block"
        assert sorted(h for _, h in pairs) == sorted(b for r in out.swapped_out for b in r.host_block_table)
        if n:
            assert not out.swapped_in and all(r in prev_running for r in scheduled)

        # Resumes: ahead of new arrivals, in queue order, keeping their progress.
        assert out.swapped_in == prev_swapped[: len(out.swapped_in)]
        for r in out.swapped_in:
            self.num_swap_ins += 1
            event("swapped in")
            assert not r.host_block_table
            num_copied = len([p for p in out.swap_in if p[1] in r.block_table])
            hits = cdiv(r.num_computed_tokens, cfg.block_size) - num_copied
            if hits:
                event("swap-in prefix hit")
                self.num_swap_in_hits += hits
        assert len({d for _, d in out.swap_in}) == len(out.swap_in)
        admitted = [r for r in scheduled if r in prev_waiting]
        if admitted:
            assert not s.swapped, "a new request was admitted while another is swapped out"
        joined = len(out.swapped_in) + len(admitted)
        if joined and len(scheduled) >= 2:
            # The last one joined next to a running request: the watermark held.
            assert self.pool.num_free_blocks >= s.watermark_blocks

    def check_state(self) -> None:
        s = self.s
        s.check_integrity()
        self.kv.check_integrity()
        self.pool.check_integrity()
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            assert self.host_pool.num_used_blocks == sum(len(r.host_block_table) for r in s.swapped)
        self.device_holders()
        self.check_running([*s.waiting, *s.swapped])
        for r in s.running:
            self.assert_holds_prefix(r, r.block_table, self.device, "device")
        for r in s.swapped:
            assert r.num_computed_tokens < r.num_tokens
            self.assert_holds_prefix(r, r.host_block_table, self.host, "host")

    def drain(self) -> None:
        pending = [r for group in self.pending_siblings.values() for r in group]
        bound = sum(self.s.max_total_tokens(r) for r in [*self.s.requests.values(), *pending])
        steps = 0
        rng = random.Random(len(self.submitted))
        while self.s.has_unfinished() or self.pending_siblings:
            assert steps <= bound + 1, f"no progress after {steps} steps"
            abort_out = 0 if rng.random() < self.drain_abort_rate else None
            abort_in = 0 if rng.random() < self.drain_abort_rate else None
            self.step(StepOp(steps, abort_out, abort_in))
            steps += 1
        self.check_all_free()

    def check_all_free(self) -> None:
        super().check_all_free()
        assert not self.s.swapped
        if self.host_pool is not None:
            assert self.host_pool.num_free_blocks == self.host_pool.num_blocks
            self.host_pool.check_integrity()
        assert all(r.host_block_table == [] for r in self.submitted)

    def run(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Submit):
                self.submit(op)
            elif isinstance(op, StepOp):
                self.step(op)
            elif isinstance(op, Abort):
                self.abort(op)
            elif isinstance(op, AbortSample):
                self.abort_sample(op)
            else:
                self.reset_prefix_cache()
        self.drain()


# -- strategies ------------------------------------------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> Config:
    # Small pools, several sequences and requests that grow by about half the pool: most runs
    # run out of blocks and preempt.
    num_blocks = draw(st.integers(3, 24))
    block_size = draw(st.sampled_from([1, 2, 4]))
    mode = draw(st.sampled_from(["auto", "swap", "auto", "recompute"]))
    # "swap" needs a host pool (the engine refuses the config otherwise).
    host_sizes = [64, 16, 4, 1] if mode == "swap" else [64, 16, 4, 1, 0]
    return Config(
        num_blocks=num_blocks,
        num_host_blocks=draw(st.sampled_from(host_sizes)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(2, 8)),
        max_num_batched_tokens=draw(st.integers(8, 48) | st.integers(1, 8)),
        max_model_len=draw(st.integers(num_blocks * block_size, 2 * num_blocks * block_size + 2)),
        mode=mode,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        swap_overhead_tokens=draw(st.sampled_from([4.0, 0.0, 8.0, 64.0])),
        swap_cost_per_token=draw(st.sampled_from([0.1, 0.25, 0.5])),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
        eos_rate=draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])),
    )


def submits_for(cfg: Config) -> st.SearchStrategy[Submit]:
    capacity = min(cfg.num_blocks * cfg.block_size, cfg.max_model_len)
    return st.builds(
        Submit,
        prompt_len=st.integers(1, max(1, capacity // 3)) | st.integers(1, capacity + 2),
        max_tokens=st.integers(max(1, capacity // 4), max(1, min(capacity // 2, 32))) | st.integers(1, 8),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        family=st.integers(0, 1),
        diverge_at=st.none() | st.integers(0, capacity),
        tail_seed=st.integers(0, 3),
        salt=st.none() | st.none() | st.just("x"),
        eos=st.booleans(),
    )


steps = st.builds(
    StepOp,
    seed=st.integers(0, 2**16),
    abort_swapped_out=st.none() | st.integers(0, 3),
    abort_swapped_in=st.none() | st.integers(0, 3),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Config, float, list[Op]]:
    cfg = draw(configs())
    submits = submits_for(cfg)
    aborts = st.builds(Abort, index=st.integers(0, 50), swapped=st.booleans())
    sample_aborts = st.builds(AbortSample, group=st.integers(0, 7), sample=st.integers(0, 2))
    # A burst of submissions first, so that the pool is contended from the start.
    burst: list[Op] = list(draw(st.lists(submits, min_size=2, max_size=6)))
    ops = draw(
        st.lists(
            st.one_of(
                submits,
                submits,
                steps,
                steps,
                steps,
                steps,
                aborts,
                sample_aborts,
                st.just(ResetPrefixCache()),
            ),
            min_size=4,
            max_size=50,
        )
    )
    return cfg, draw(st.sampled_from([0.0, 0.3])), burst + ops


@settings(deadline=None, max_examples=250)
@given(scenario=scenarios())
def test_swap_and_recompute_interleavings_keep_every_invariant(
    scenario: tuple[Config, float, list[Op]],
) -> None:
    cfg, drain_abort_rate, ops = scenario
    harness = Harness(cfg, drain_abort_rate)
    harness.run(ops)
    target(float(harness.num_swap_outs), label="swap-outs")
    target(float(harness.s.num_recompute_preemptions), label="recomputes")
    target(float(harness.num_aborted_in_flight), label="aborts during a swap")


@settings(deadline=None, max_examples=100)
@given(cfg=configs(), data=st.data())
def test_accepted_requests_all_finish(cfg: Config, data: st.DataObject) -> None:
    """Liveness: submit everything up front, then only step."""
    harness = Harness(cfg)
    for op in data.draw(st.lists(submits_for(cfg), min_size=1, max_size=10)):
        harness.submit(op)
    harness.drain()
    for r in harness.submitted:
        assert r.finish_reason in ("stop", "length")
    target(float(harness.num_swap_outs), label="swap-outs")


# -- crafted runs: each behaviour surely happens ----------------------------------------------


def crafted(mode: str, num_host_blocks: int = 64, **kwargs: object) -> Harness:
    fields: dict[str, object] = dict(
        num_blocks=12,
        num_host_blocks=num_host_blocks,
        block_size=2,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        max_model_len=64,
        mode=mode,
        eos_rate=0.0,
    )
    fields.update(kwargs)
    return Harness(Config(**fields))  # type: ignore[arg-type]


def pressure_ops(n: int = 1) -> list[Op]:
    """Four growing requests (one with `n` samples) on a 12-block pool: preemption is certain."""
    return [
        Submit(6, 10, n=n, family=0),
        Submit(5, 10, family=1, diverge_at=0, tail_seed=1),
        Submit(7, 10, family=1, diverge_at=2, tail_seed=2),
        Submit(4, 10, family=0, diverge_at=0, tail_seed=3),
    ]


def test_swap_mode_swaps_and_resumes_with_progress() -> None:
    h = crafted("swap")
    h.run(pressure_ops())
    assert h.s.num_swap_preemptions > 0 and h.s.num_recompute_preemptions == 0
    assert h.s.num_blocks_swapped_out > 0 and h.s.num_blocks_swapped_in > 0
    assert h.num_swap_ins == h.num_swap_outs


def test_recompute_mode_never_swaps() -> None:
    h = crafted("recompute")
    h.run(pressure_ops())
    assert h.s.num_recompute_preemptions > 0 and h.s.num_swap_preemptions == 0
    assert h.s.num_blocks_swapped_out == 0 and h.host_pool is not None and h.host_pool.num_used_blocks == 0


def test_swap_mode_recomputes_when_the_host_pool_is_full() -> None:
    h = crafted("swap", num_host_blocks=1)
    h.run(pressure_ops())
    assert h.s.num_recompute_preemptions > 0


def test_auto_picks_by_cost() -> None:
    # Free swaps: every victim is swapped; prohibitive swaps: every victim recomputed.
    cheap = crafted("auto", swap_overhead_tokens=0.0, swap_cost_per_token=0.01)
    cheap.run(pressure_ops())
    assert cheap.s.num_swap_preemptions > 0 and cheap.s.num_recompute_preemptions == 0
    dear = crafted("auto", swap_overhead_tokens=1000.0)
    dear.run(pressure_ops())
    assert dear.s.num_recompute_preemptions > 0 and dear.s.num_swap_preemptions == 0


def test_auto_recomputes_a_victim_whose_prefix_is_shared() -> None:
    """Siblings share the prompt's blocks: recomputing one costs only its own tokens."""
    h = crafted("auto", num_blocks=16, block_size=4, max_num_batched_tokens=64)
    s = h.s
    h.submit(Submit(16, 12, n=3))
    h.step(StepOp(seed=0))  # the first sample computes the prompt; the siblings join
    h.step(StepOp(seed=1))
    victim = s.running[-1]
    assert h.kv.num_shared_prefix_blocks(victim) >= 3
    assert s.preemption.recompute_cost(victim) < s.preemption.swap_cost(victim)
    assert not s.preemption.by_swap(victim)
    h.drain()


def test_swap_in_shares_blocks_still_cached() -> None:
    """A swapped-out sample finds its prompt blocks cached by its siblings: they are not copied."""
    h = crafted("swap", num_blocks=14, block_size=4, max_num_batched_tokens=64)
    h.run([Submit(16, 20, n=3), *[StepOp(seed=i) for i in range(12)]])
    assert h.s.num_swap_preemptions > 0
    assert h.num_swap_in_hits > 0
    assert h.s.num_blocks_swapped_in < h.s.num_blocks_swapped_out


def test_abort_during_swap_out_and_swap_in() -> None:
    found_out = found_in = False
    for seed in range(40):
        rng = random.Random(seed)
        h = crafted(rng.choice(["swap", "auto"]), swap_overhead_tokens=0.0)
        ops: list[Op] = list(pressure_ops(n=rng.choice([1, 2])))
        ops += [StepOp(rng.randrange(2**16), rng.choice([None, 0]), rng.choice([None, 0])) for _ in range(30)]
        h.run(ops)
        found_out |= h.num_aborted_swapping_out > 0
        found_in |= h.num_aborted_swapping_in > 0
    assert found_out and found_in


def test_watermark_keeps_admissions_from_preempting() -> None:
    """With a watermark, the second request waits while the pool is nearly full."""
    h = crafted("swap", num_blocks=10, block_size=2, watermark=0.3)
    assert h.s.watermark_blocks == math.ceil(0.3 * 10)
    h.submit(Submit(10, 4))  # 5 blocks
    h.submit(Submit(6, 2, family=1))  # 3 blocks: 10 - 5 - 3 < 3
    h.step(StepOp(seed=0))
    assert [r.request_id for r in h.s.running] == ["r0"]
    assert [r.request_id for r in h.s.waiting] == ["r1"]
    h.drain()
    assert h.s.num_preemptions == 0


def test_swapped_requests_resume_before_new_arrivals() -> None:
    h = crafted("swap", num_blocks=8, block_size=2, max_num_seqs=4)
    h.submit(Submit(4, 8))
    h.submit(Submit(4, 8, family=1))
    while not h.s.swapped:
        h.step(StepOp(seed=h.num_steps))
    swapped = h.s.swapped[0]
    h.submit(Submit(1, 1, family=1, diverge_at=0))  # tiny: it would fit before the swapped one
    newcomer = h.s.waiting[-1]
    while swapped.status is RequestStatus.SWAPPED:
        assert newcomer.status is RequestStatus.WAITING
        h.step(StepOp(seed=h.num_steps))
    h.drain()


def test_abort_a_swapped_out_request_frees_its_host_blocks() -> None:
    h = crafted("swap", num_blocks=8, block_size=2, max_num_seqs=4)
    h.submit(Submit(4, 8))
    h.submit(Submit(4, 8, family=1))
    while not h.s.swapped:
        h.step(StepOp(seed=h.num_steps))
    victim = h.s.swapped[0]
    assert h.host_pool is not None and h.host_pool.num_used_blocks == len(victim.host_block_table) > 0
    h.abort(Abort(0, swapped=True))
    assert victim.status is RequestStatus.FINISHED_ABORTED
    assert h.host_pool.num_used_blocks == 0 and not h.s.swapped
    h.drain()


def test_aborting_one_sample_leaves_its_siblings_running() -> None:
    """A group of 3 under pressure: one sample aborted while swapped out, one while running;
    the third finishes its tokens, and both pools end all free."""
    h = crafted("swap", num_blocks=14, block_size=4, max_num_batched_tokens=64)
    h.submit(Submit(16, 20, n=3))
    while not h.s.swapped:
        h.step(StepOp(seed=h.num_steps))
    (group,) = h.groups
    swapped = h.s.swapped[0]
    h.abort_sample(AbortSample(0, group.index(swapped)))  # (every sample is live: index = position)
    assert swapped.status is RequestStatus.FINISHED_ABORTED and not h.s.swapped
    running = [r for r in group if r.status is RequestStatus.RUNNING]
    live = [r for r in group if not r.status.finished]
    h.abort_sample(AbortSample(0, live.index(running[0])))
    (survivor,) = [r for r in group if not r.status.finished]
    h.drain()
    assert survivor.finish_reason == "length" and survivor.num_output_tokens == 20
    assert h.num_sample_aborts == 2
