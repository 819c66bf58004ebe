"""`bench quality`: its margin and divergence arithmetic, and the teacher-forced pass on a
tiny model (a variant equal to the reference moves no margin)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedserve.benchmarks.quality import (
    VARIANTS,
    build_parser,
    first_divergence,
    quantiles,
    teacher_forced,
    top2_margin,
)


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([9], [1]) == 0


def test_top2_margin_is_the_logit_gap() -> None:
    # log-probabilities share one normaliser: their gap is the logits' gap, in any order.
    assert top2_margin([(7, -0.5), (3, -2.0)]) == 1.5
    assert top2_margin([(3, -2.0), (7, -0.5)]) == 1.5


def test_quantiles() -> None:
    assert quantiles([float(i) for i in range(10)]) == [1.0, 5.0, 9.0]
    assert quantiles([4.0]) == [4.0, 4.0, 4.0]


def test_variants_and_defaults() -> None:
    assert list(VARIANTS) == ["fp32", "bf16", "int8-weights", "int8"]
    assert VARIANTS["int8-weights"] == {"quantization": "int8", "quantized_matmul": "float32"}
    args = build_parser().parse_args([])
    assert args.models == "SmolLM2-135M-Instruct,shape:qwen2-0.5b"
    assert (args.max_ppl_tokens, args.num_prompts, args.max_tokens) == (1024, 48, 32)


def test_teacher_forced_against_itself(tiny: Path) -> None:
    import torch

    from pagedserve.dataplane import LLM

    llm = LLM(
        str(tiny), dtype="float32", kv_cache_memory=16 << 20, max_model_len=128, enable_prefix_caching=False
    )
    ids = [(7 * i + 3) % 384 for i in range(50)]
    ref = teacher_forced(llm, ids, chunk=16)
    assert ref["argmax"].shape == (49,) and ref["top2"].shape == (49, 2)
    assert bool((ref["own_margins"] >= 0).all())
    assert math.isfinite(ref["perplexity"]) and ref["perplexity"] > 1
    again = teacher_forced(llm, ids, chunk=16, ref_top2=ref["top2"])
    assert torch.equal(again["argmax"], ref["argmax"])
    assert again["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6)
    assert torch.allclose(again["margins"], ref["own_margins"], atol=1e-5)


def test_engine_int8_weights_are_the_reference_int8(tiny: Path) -> None:
    """The engine's --quantization int8 --quantized-matmul float32 measures what per-channel
    int8 weights mean: transformers' forward on the de-quantized weights gives the same
    perplexity, argmax and margins (the check behind docs/quantization.md's 0/48 finding)."""
    import torch

    from pagedserve.benchmarks.quality import reference_int8
    from pagedserve.dataplane import LLM

    ids = [(7 * i + 3) % 384 for i in range(50)]
    fp32 = LLM(
        str(tiny), dtype="float32", kv_cache_memory=16 << 20, max_model_len=128, enable_prefix_caching=False
    )
    ref = teacher_forced(fp32, ids, chunk=16)
    del fp32
    int8 = LLM(
        str(tiny),
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_model_len=128,
        enable_prefix_caching=False,
        quantization="int8",
        quantized_matmul="float32",
    )
    ours = teacher_forced(int8, ids, chunk=16, ref_top2=ref["top2"])
    theirs = reference_int8(tiny, ids, ref["top2"], None)
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=1e-5)
    assert ours["perplexity"] != pytest.approx(ref["perplexity"], rel=1e-5)  # the rounding shows
    assert torch.equal(ours["argmax"], theirs["argmax"])
    assert torch.allclose(ours["margins"], theirs["margins"], atol=1e-3)
