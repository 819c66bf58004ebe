"""The mixed-step budget, without a model: what it learns from step times, the exact prompt
tokens it allows, and how the scheduler applies it (with the fixed bound, and for a request
that outranks every decoding one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.config import SchedulerConfig, engine_config
from pagedserve.dataplane.engine.llm_engine import LLMEngine
from pagedserve.dataplane.kvcache import BlockPool, KVCacheManager
from pagedserve.dataplane.scheduler import Request, Scheduler, SchedulerOutput
from pagedserve.dataplane.scheduler.output import ScheduledRequest
from pagedserve.dataplane.scheduler.step_budget import (
    MIN_PROMPT_TOKENS,
    MixedStepBudget,
    split_tokens,
)


def learned(stretch: float, decode_s: float, prompt_token_s: float) -> MixedStepBudget:
    """A budget that has seen one decode-only step and one prompt-only step of 100 tokens."""
    budget = MixedStepBudget(stretch)
    budget.observe(0, 3, decode_s)
    budget.observe(100, 0, 100 * prompt_token_s)
    return budget


def test_nothing_is_bounded_until_both_costs_are_measured() -> None:
    budget = MixedStepBudget(1.5)
    assert budget.tokens() is None
    budget.observe(0, 1, 0.020)
    assert budget.tokens() is None  # no prompt token timed yet
    budget = MixedStepBudget(1.5)
    budget.observe(40, 0, 0.040)
    assert budget.tokens() is None  # no decode-only step timed yet


def test_the_budget_stretches_a_mixed_step_by_at_most_stretch_decode_steps() -> None:
    budget = MixedStepBudget(1.5)
    budget.observe(0, 1, 0.020)  # a decode-only step: 20 ms
    budget.observe(30, 1, 0.050)  # 30 prompt tokens beside it took 30 ms more: 1 ms a token
    assert budget.decode_step_s == pytest.approx(0.020)
    assert budget.prompt_token_s == pytest.approx(0.001)
    # 1.5 x 20 ms of spare time at 1 ms a prompt token
    assert budget.tokens() == 30
    assert MixedStepBudget(2.0).tokens() is None
    assert learned(2.0, 0.020, 0.001).tokens() == 40


def test_step_times_are_smoothed_means() -> None:
    budget = MixedStepBudget(1.0, smoothing=0.5)
    budget.observe(0, 1, 0.020)
    budget.observe(0, 1, 0.040)
    assert budget.decode_step_s == pytest.approx(0.030)
    budget.observe(10, 0, 0.010)
    budget.observe(10, 0, 0.030)
    assert budget.prompt_token_s == pytest.approx(0.002)
    assert budget.tokens() == 15


def test_steps_that_say_little_about_a_prompt_token_are_not_sampled() -> None:
    budget = learned(1.0, 0.020, 0.001)
    budget.observe(7, 1, 0.5)  # fewer than 8 prompt tokens
    budget.observe(0, 0, 0.5)  # nothing computed (first-token draws only)
    budget.observe(50, 1, 0.0)  # no time
    assert budget.prompt_token_s == pytest.approx(0.001)
    assert budget.decode_step_s == pytest.approx(0.020)


def test_a_mixed_step_no_longer_than_a_decode_step_still_counts_a_tenth_of_itself() -> None:
    budget = MixedStepBudget(1.0, smoothing=1.0)
    budget.observe(0, 1, 0.020)
    budget.observe(10, 1, 0.015)  # noise: shorter than the decode step alone
    assert budget.prompt_token_s == pytest.approx(0.0015 / 10)


def test_the_budget_never_goes_below_its_floor() -> None:
    assert learned(0.5, 0.001, 0.010).tokens() == MIN_PROMPT_TOKENS


@pytest.mark.parametrize("stretch", [0.0, -2.0])
def test_a_stretch_of_zero_or_less_is_refused(stretch: float) -> None:
    with pytest.raises(ValueError, match=f"the prefill stretch must be above 0, got {stretch}"):
        MixedStepBudget(stretch)


def test_the_setting_is_off_by_default_and_bounded() -> None:
    assert SchedulerConfig().prefill_stretch == 0
    assert SchedulerConfig(prefill_stretch=1.5).prefill_stretch == 1.5
    with pytest.raises(ValueError, match="prefill_stretch"):
        SchedulerConfig(prefill_stretch=-1)


def request(rid: str, prompt_len: int, max_tokens: int = 20, priority: int = 0) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, [base + i for i in range(prompt_len)], params, priority=priority)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    plan = [(item.request.request_id, item.num_new_tokens) for item in out.scheduled]
    s.update_from_output(out, {item.request.request_id: 7 for item in out.scheduled if item.samples})
    s.check_integrity()
    return plan


def scheduler(budget: MixedStepBudget, fixed: int | None = None) -> Scheduler:
    kv = KVCacheManager(BlockPool(128), 4)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0, max_prefill_tokens_while_decoding=fixed
    )
    return Scheduler(kv, config, 256, mixed_step_budget=budget)


def test_the_scheduler_prefills_the_learned_budget_while_a_request_decodes() -> None:
    s = scheduler(learned(1.0, 0.010, 0.001))  # 10 prompt tokens a mixed step
    s.add_request(request("guard", 6))
    assert run_step(s) == [("guard", 6)]  # nothing decodes yet: the whole step's budget
    s.add_request(request("a", 12))
    s.add_request(request("b", 12))
    assert run_step(s) == [("guard", 1), ("a", 10)]
    assert run_step(s) == [("guard", 1), ("a", 2), ("b", 8)]
    assert run_step(s) == [("guard", 1), ("a", 1), ("b", 4)]


def test_the_smaller_of_the_fixed_bound_and_the_learned_budget_applies() -> None:
    for fixed, first in ((4, 4), (30, 10)):
        s = scheduler(learned(1.0, 0.010, 0.001), fixed=fixed)
        s.add_request(request("guard", 6))
        run_step(s)
        s.add_request(request("a", 12))
        assert run_step(s) == [("guard", 1), ("a", first)]


def test_a_request_that_outranks_every_decoding_one_prefills_whole() -> None:
    s = scheduler(learned(1.0, 0.010, 0.001))
    s.add_request(request("low", 6, priority=10))
    run_step(s)
    s.add_request(request("later", 24, priority=10))  # no better than the decoding one: bounded
    s.add_request(request("urgent", 24, priority=0))
    # the urgent one's 24 tokens on top of the 10 the budget allows; it goes first
    assert run_step(s) == [("low", 1), ("urgent", 24), ("later", 10)]
    # now the urgent one decodes (and runs first): the rest of later's prompt is bounded again
    assert run_step(s) == [("urgent", 1), ("low", 1), ("later", 10)]


def test_split_tokens_counts_prompt_chunks_and_decodes() -> None:
    decoding = request("d", 4)
    decoding.num_computed_tokens = 4
    decoding.append_output_token(7)  # its next step computes one output token
    prefilling = request("p", 20)
    out = SchedulerOutput(scheduled=[ScheduledRequest(decoding, 1), ScheduledRequest(prefilling, 12)])
    assert split_tokens(out) == (12, 1)


# -- on a real (tiny) model -------------------------------------------------------------------


class Pinned(MixedStepBudget):
    """Answers a fixed budget (so the plan is exact) and counts the steps it was shown."""

    def __init__(self, tokens: int) -> None:
        super().__init__(1.0)
        self.pinned = tokens
        self.observed: list[tuple[int, int]] = []

    def observe(self, prompt_tokens: int, decode_tokens: int, seconds: float) -> None:
        assert seconds > 0
        self.observed.append((prompt_tokens, decode_tokens))
        super().observe(prompt_tokens, decode_tokens, seconds)

    def tokens(self) -> int | None:
        return self.pinned


def burst_beside_a_stream(
    model: Path, stretch: float, pinned: int | None = None
) -> tuple[LLMEngine, dict[str, list[int]], list[tuple[int, int, int | None]]]:
    """A greedy stream decodes, then 6 prompts of 40 tokens arrive at once. Each request's
    tokens, and per step (prompt tokens, decode tokens, the budget it was scheduled under)."""
    engine = LLMEngine(engine_config(model=str(model), max_model_len=128, prefill_stretch=stretch))
    if pinned is not None:
        engine.scheduler.mixed_step_budget = Pinned(pinned)
    budget = engine.scheduler.mixed_step_budget
    steps: list[tuple[int, int, int | None]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        allowed = budget.tokens() if budget is not None else None
        out = schedule()
        steps.append((*split_tokens(out), allowed))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request([3 + k for k in range(10)], params, request_id="stream")
    for _ in range(3):
        engine.step()
    for i in range(6):
        engine.add_request([5 + (31 * i + 7 * k) % 300 for k in range(40)], params, request_id=f"new{i}")
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    names = ["stream"] + [f"new{i}" for i in range(6)]
    tokens = {rid: engine.samples_of(rid)[0].output_token_ids for rid in names}
    for rid in names:
        engine.release(rid)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return engine, tokens, steps


def test_without_a_stretch_the_burst_prefills_in_one_step(tiny: Path) -> None:
    engine, _, steps = burst_beside_a_stream(tiny, 0)
    assert engine.scheduler.mixed_step_budget is None
    assert steps[3][:2] == (240, 1)  # the stream's decode and all six prompts at once


def test_the_engine_times_its_steps_and_keeps_mixed_steps_in_the_budget(tiny: Path) -> None:
    _, reference, _ = burst_beside_a_stream(tiny, 0)
    engine, tokens, steps = burst_beside_a_stream(tiny, 1.0)
    budget = engine.scheduler.mixed_step_budget
    assert budget is not None and budget.stretch == 1.0
    assert budget.decode_step_s is not None and budget.decode_step_s > 0
    assert budget.prompt_token_s is not None and budget.prompt_token_s > 0
    assert steps[0] == (10, 0, None)  # the stream's prompt alone: nothing measured, no bound
    for prompt, decode, allowed in steps:
        if decode and allowed is not None:
            assert prompt <= allowed
    assert tokens == reference  # chunking the prompts changes no token


def test_a_pinned_budget_spreads_the_burst_exactly(tiny: Path) -> None:
    _, reference, _ = burst_beside_a_stream(tiny, 0)
    engine, tokens, steps = burst_beside_a_stream(tiny, 1.0, pinned=16)
    # 240 prompt tokens, 16 a step beside the decoding requests: 15 steps
    assert [prompt for prompt, _, _ in steps[3:18]] == [16] * 15
    assert steps[18][0] == 0
    pinned = engine.scheduler.mixed_step_budget
    assert isinstance(pinned, Pinned)
    assert [(p, d) for p, d, _ in steps] == pinned.observed  # every step was timed
    assert tokens == reference
