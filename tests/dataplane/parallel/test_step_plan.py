"""A step's plan survives packing into one int64 tensor, and garbage is refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedserve.dataplane.parallel import step_plan
from pagedserve.dataplane.runner.model_runner import StepInputs


def test_round_trip_keeps_every_field() -> None:
    inputs = StepInputs(
        input_ids=[5, 6, 7, 8, 9],
        positions=[0, 1, 2, 40, 17],
        query_lens=[3, 1, 1],
        seq_lens=[3, 41, 18],
        block_tables=[[4], [0, 1, 2], [7, 9]],
        swap_out=[(3, 0), (5, 1)],
        swap_in=[(2, 11)],
    )
    plan = step_plan.pack(inputs)
    assert plan.dtype == torch.int64 and plan.dim() == 1
    # header + 2 x tokens + 3 x sequences + table entries + 2 x swap pairs
    assert plan.numel() == step_plan.HEADER + 2 * 5 + 3 * 3 + 6 + 2 * 3
    assert step_plan.unpack(plan) == inputs


def test_an_empty_step_and_a_swap_only_plan() -> None:
    for inputs in (StepInputs([], [], [], [], []), StepInputs([], [], [], [], [], swap_in=[(1, 2)])):
        assert step_plan.unpack(step_plan.pack(inputs)) == inputs


def test_a_tensor_that_is_not_a_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="not a step plan"):
        step_plan.unpack(torch.zeros(8, dtype=torch.int64))
    plan = step_plan.pack(StepInputs([1], [0], [1], [1], [[0]]))
    with pytest.raises(ValueError, match="header describes"):
        step_plan.unpack(torch.cat([plan, torch.tensor([99])]))
