"""Routing score: cached prefix against load; only candidates that fit are chosen."""

from __future__ import annotations

import pytest

from pagedserve.controlplane.config import RoutingWeights
from pagedserve.controlplane.routing.router import Candidate, choose, score


def cand(name: str, **kw: int) -> Candidate:
    base = dict(
        prompt_blocks=10,
        cached_blocks=0,
        need_blocks=11,
        available_blocks=100,
        total_blocks=100,
        num_running=0,
        num_waiting=0,
        in_flight=0,
        max_num_seqs=8,
    )
    base.update(kw)
    return Candidate(dataplane=name, **base)  # type: ignore[arg-type]


W = RoutingWeights()


def test_score_formula() -> None:
    c = cand(
        "a", cached_blocks=5, need_blocks=6, available_blocks=50, num_running=2, num_waiting=1, in_flight=1
    )
    # 1.0 * 5/10 - 0.5 * (1 - (50 - 6)/100) - 0.5 * max(3, 1)/8
    assert score(c, W) == pytest.approx(0.5 - 0.5 * 0.56 - 0.5 * 3 / 8)


def test_cached_prefix_beats_a_moderately_busier_data_plane() -> None:
    hot = cand("hot", cached_blocks=10, need_blocks=1, available_blocks=60, num_running=3)
    cold = cand("cold", available_blocks=100)
    assert choose([cold, hot], W) == hot


def test_without_prefix_the_least_loaded_wins() -> None:
    busy = cand("a", in_flight=3)
    idle = cand("b", in_flight=0)
    assert choose([busy, idle], W) == idle


def test_ties_break_on_in_flight_then_address() -> None:
    assert choose([cand("b"), cand("a")], W) == cand("a")


def test_only_candidates_that_fit_are_chosen() -> None:
    full = cand("full", cached_blocks=10, need_blocks=5, available_blocks=4)
    assert choose([full], W) is None
    assert choose([full, cand("ok")], W) == cand("ok")


def test_prefix_weight_zero_ignores_the_cache() -> None:
    weights = RoutingWeights(prefix_weight=0.0)
    hot = cand("hot", cached_blocks=10, need_blocks=1, in_flight=4)
    cold = cand("cold")
    assert choose([hot, cold], weights) == cold


def test_negative_weight_is_rejected() -> None:
    with pytest.raises(ValueError, match="load_weight"):
        RoutingWeights(load_weight=-1)
