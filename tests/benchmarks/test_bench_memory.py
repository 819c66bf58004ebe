"""`bench memory`: replay through our scheduler and pool, with figures worked out by hand."""

from __future__ import annotations

import pytest

from pagedserve.benchmarks.memory import Allocation, replay
from pagedserve.benchmarks.traces import LengthTrace, load_trace
from pagedserve.dataplane.kvcache.budget import KVCacheShape

# 2 bytes per token, so `kv_memory = 2 * slots` gives exactly `slots` token slots.
TWO_BYTES = KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=1, bytes_per_element=1)


def trace(*requests: tuple[int, int]) -> LengthTrace:
    return LengthTrace(
        workload="hand",
        description="",
        model="",
        max_tokens=0,
        prompt_tokens=tuple(p for p, _ in requests),
        output_tokens=tuple(o for _, o in requests),
        finish_reasons=("stop",) * len(requests),
    )


FOUR_OF_8_PLUS_8 = trace((8, 8), (8, 8), (8, 8), (8, 8))


def test_contiguous_reserves_max_model_len_per_request() -> None:
    # 64 slots, max_model_len 32: two reservations. Each request writes the KV of 8 prompt
    # tokens in step 1 and one more per step; it samples its 8th token in step 8 and leaves
    # (final KV 15 tokens: the last sampled token is never computed). Steps 1-8 have two
    # requests waiting (the saturated window); steps 9-16 run the other two.
    r = replay(FOUR_OF_8_PLUS_8, Allocation("contiguous", 0), 32, shape=TWO_BYTES, kv_memory=2 * 64)
    assert (r.num_units, r.requests, r.refused, r.truncated) == (2, 4, 0, 0)
    assert (r.steps, r.window_steps, r.saturated, r.preemptions, r.output_tokens) == (16, 8, True, 0, 32)
    assert (r.peak_running, r.mean_running) == (2, 1.75)
    # stored = sum_{t=1..7} 2 (7 + t) = 154 of 7 x 64 = 448 reserved slots.
    assert r.utilization == pytest.approx(154 / 448)
    assert r.internal_never == pytest.approx(2 * 17 * 7 / 448)  # 32 - 15 slots never written, each
    assert r.internal_pending == pytest.approx(56 / 448)
    assert r.external == 0.0
    assert r.free_while_waiting == pytest.approx(64 / (64 * 8))  # step 8: both left, two still wait


def test_paged_takes_blocks_as_tokens_grow() -> None:
    # 16 blocks of 4: all four fit from step 1 (2 blocks each) and never wait. A request holds
    # 8 slots after step 1, 12 after steps 2-5, 16 after steps 6-7: 88 slot-steps for 77 tokens.
    r = replay(FOUR_OF_8_PLUS_8, Allocation("paged", 4), 32, shape=TWO_BYTES, kv_memory=2 * 64)
    assert (r.num_units, r.steps, r.saturated, r.preemptions, r.peak_running) == (16, 8, False, 0, 4)
    assert r.utilization == pytest.approx(77 / 88)
    assert r.internal_never == pytest.approx(2 / 88)  # the 16th slot, in steps 6 and 7
    assert r.mean_running == pytest.approx(28 / 8)


def test_paged_pool_preempts_when_it_runs_dry_and_frees_everything() -> None:
    # 6 blocks of 4 (24 slots): three prompts of 8 fit, then growth needs a 7th block.
    r = replay(trace((8, 8), (8, 8), (8, 8)), Allocation("paged", 4), 32, shape=TWO_BYTES, kv_memory=2 * 24)
    assert r.preemptions >= 1
    assert r.output_tokens >= 24  # recomputation re-samples nothing: each request yields its 8 tokens once
    assert r.peak_running == 3


def test_refused_and_truncated_requests_and_the_pools_remainder() -> None:
    # max_model_len 16: a prompt of 16 is refused; 12 + 8 is cut at 16 tokens.
    r = replay(
        trace((16, 4), (12, 8), (4, 4)), Allocation("contiguous", 0), 16, shape=TWO_BYTES, kv_memory=2 * 40
    )
    assert (r.refused, r.truncated, r.num_units) == (1, 1, 2)
    assert r.external == pytest.approx(8 / 40)  # 40 slots hold two units of 16
    assert r.output_tokens == 4 + 4


def test_shipped_traces_load() -> None:
    for name in ("chat", "customer-service", "long-context"):
        t = load_trace(name)
        assert t.workload == name and t.num_requests >= 16
        assert max(t.output_tokens) <= t.max_tokens
    with pytest.raises(FileNotFoundError, match="no trace"):
        load_trace("no-such-workload")
