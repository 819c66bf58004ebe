"""The sampler on hand-made logits: exact tokens, filtering, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.dataplane.runner.sampler import _filtered_probs, apply_penalties, sample

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 1.0, 4.9, 0.0, 0.0]])


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax() -> None:
    out = sample(LOGITS, [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert [t.token_id for t in out] == [1, 0]
    assert all(t.logprob is None for t in out)


def test_filters_keep_exactly_the_expected_tokens() -> None:
    probs = _filtered_probs(LOGITS[:1], [SamplingParams(top_k=2)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3]
    probs = _filtered_probs(LOGITS[:1], [SamplingParams(top_p=0.5)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1]  # p(token 1) = 0.64 already covers 0.5
    probs = _filtered_probs(LOGITS[1:], [SamplingParams(min_p=0.5)])
    assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 2]  # e^-0.1 = 0.90 >= 0.5; the rest < 0.5
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


def test_seeded_draws_repeat_and_differ_between_seeds() -> None:
    params = [SamplingParams(temperature=5.0, seed=3)] * 2
    draws = [tuple(t.token_id for t in sample(LOGITS, params, [gen(3), gen(3)])) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    many = {sample(LOGITS[:1], params[:1], [gen(s)])[0].token_id for s in range(40)}
    assert len(many) > 2  # a hot temperature over 5 tokens really samples


def test_penalties() -> None:
    row = torch.tensor([2.0, -2.0, 1.0])
    rep = apply_penalties(row, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0]
    freq = apply_penalties(row, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [2], [0, 0, 2])
    assert freq.tolist() == pytest.approx([2.0 - 1.0 - 0.25, -2.0, 1.0 - 0.5 - 0.25])
    # A strong repetition penalty moves greedy off the repeated token.
    out = sample(LOGITS[:1], [SamplingParams(temperature=0.0, repetition_penalty=10.0)], [None], [([1], [])])
    assert out[0].token_id == 3


def test_logprobs_are_raw_log_softmax() -> None:
    out = sample(LOGITS, [SamplingParams(temperature=0.0, logprobs=2)] * 2, [None, None])
    expected = LOGITS.log_softmax(-1)
    assert out[0].logprob == pytest.approx(float(expected[0, 1]))
    assert out[0].top_logprobs is not None
    assert [t for t, _ in out[0].top_logprobs] == [1, 3]
    assert math.isclose(out[1].top_logprobs[1][1], float(expected[1, 2]), rel_tol=1e-6)  # type: ignore[index]
