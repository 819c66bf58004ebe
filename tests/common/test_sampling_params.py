"""SamplingParams validation: every bad field raises ValueError naming that field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pagedserve.common.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.greedy is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", None),
        ("temperature", -0.01),
        ("temperature", -math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.nan),
        ("seed", -1),
        ("seed", 1.5),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (3, -7)),
        ("stop_token_ids", (1.0,)),
        ("stop_token_ids", ("2",)),
        ("stop_token_ids", (True,)),
    ],
)
def test_bad_field_raises_value_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field) as excinfo:
        SamplingParams(**{field: value})
    # The message says what was wrong: the field and the offending value.
    assert repr(value) in str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63},
        {"stop_token_ids": (0, 5)},
        {"ignore_eos": True},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams(temperature=0.0).greedy is True
    assert SamplingParams(temperature=1e-5).greedy is False


def test_stop_token_ids_become_a_tuple() -> None:
    p = SamplingParams(stop_token_ids=[4, 2])  # type: ignore[arg-type]
    assert p.stop_token_ids == (4, 2)
    assert isinstance(p.stop_token_ids, tuple)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(4, 2)))


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("tiny", [1e-45, 1e-38, 1e-9, 0.009])
def test_a_tiny_positive_temperature_or_repetition_penalty_is_applied_as_the_minimum(tiny: float) -> None:
    """Found by the fuzz suite: 1e-45 (a valid float32) divided the logits to infinity and the
    sampler's probabilities to NaN, which ended the data plane's engine loop. Below 0.01 both
    are applied as 0.01 (vLLM raises such temperatures to 0.01 too); 0 stays greedy."""
    import torch

    from pagedserve.common.protocol import sampling_params_from_proto, sampling_params_to_proto
    from pagedserve.common.sampling_params import MIN_REPETITION_PENALTY, MIN_SAMPLING_TEMPERATURE
    from pagedserve.dataplane.runner.sampler import sample

    p = SamplingParams(temperature=tiny, repetition_penalty=tiny, seed=1)
    assert (
        (p.temperature, p.repetition_penalty)
        == (MIN_SAMPLING_TEMPERATURE, MIN_REPETITION_PENALTY)
        == (0.01, 0.01)
    )
    assert not p.greedy and SamplingParams(temperature=0.0).greedy
    assert sampling_params_from_proto(sampling_params_to_proto(p)) == p  # the wire carries the applied value
    logits = torch.randn(2, 64) * 30
    g = torch.Generator()
    g.manual_seed(1)
    tokens = sample(logits, [p, p], [g, None], [([1, 2, 3], [4]), ([5], [])])
    assert all(0 <= t.token_id < 64 for t in tokens)


def test_stop_token_ids_are_bounded() -> None:
    assert SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))).stop_token_ids[-1] == 1023
    with pytest.raises(ValueError, match=r"^stop_token_ids must hold at most 1024 token ids, got 2000000$"):
        SamplingParams(stop_token_ids=(7,) * 2_000_000)
