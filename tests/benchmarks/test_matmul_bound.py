"""The matmul bound of a throughput run (its FLOP count, the bound and the share reached), the
modules its peak probe times, and the arithmetic of the --profile components."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve.benchmarks.matmul_bound import (
    MatmulBound,
    MatmulPeak,
    matmul_bound,
    matmul_params,
    probe_modules,
    probe_peak,
    workload_flops,
)
from pagedserve.benchmarks.roofline import linear_shapes
from pagedserve.benchmarks.throughput_profile import (
    COMPONENTS,
    OUTSIDE_RUNNER,
    component_shares,
    decode_shape,
    runner_share,
)

# Qwen2-0.5B's layout with SmolLM2's vocabulary (benchmarks/src/pagedserve/benchmarks/model_shapes.py "qwen2-0.5b").
QWEN2_05B = SimpleNamespace(
    hidden_size=896,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    num_hidden_layers=24,
    vocab_size=49152,
)
# One layer: q 896x896 + k 896x128 + v 896x128 + o 896x896 + gate, up 896x4864 + down 4864x896.
LAYER = 896 * 896 + 2 * 896 * 128 + 896 * 896 + 3 * 896 * 4864


@dataclass
class FakeStep:
    kind: str
    num_batched_tokens: int
    num_sampled: int
    seconds: float = 0.0
    context_tokens: int = 0
    attention_pairs: int = 0
    runner_seconds: float = 0.0


def test_params_in_matmuls_of_the_qwen2_shape() -> None:
    shapes = linear_shapes(QWEN2_05B)
    assert LAYER == 14_909_440
    assert matmul_params(shapes) == 24 * LAYER + 896 * 49152 == 401_866_752


def test_workload_flops() -> None:
    """2 FLOPs per multiply-add: every computed token through the layers, sampled rows through the head."""
    shapes = linear_shapes(QWEN2_05B)
    assert workload_flops(shapes, 1000, 10) == 2 * 24 * LAYER * 1000 + 2 * 896 * 49152 * 10
    # A step that samples every row is 2 x params x tokens.
    assert workload_flops(shapes, 7, 7) == 2 * 401_866_752 * 7


def test_bound_of_a_run() -> None:
    """The layers' FLOPs at the layers' rate plus the head's at the head's."""
    shapes = linear_shapes(QWEN2_05B)
    # A 100-token prompt prefilled (its last row sampled), then 9 decode steps of one row.
    steps = [FakeStep("prefill", 100, 1, attention_pairs=100 * 101 // 2)]
    steps += [FakeStep("decode", 1, 1, attention_pairs=101 + i) for i in range(9)]
    peak = MatmulPeak(layer_gflops=100.0, head_gflops=50.0, by_rows={}, kernels="test")
    bound = matmul_bound(shapes, steps, peak, output_tokens=10, seconds=4.0)
    layers, head = 2 * 24 * LAYER * 109, 2 * 896 * 49152 * 10
    assert (bound.layer_flops, bound.head_flops, bound.flops) == (layers, head, layers + head)
    assert bound.attention_flops == 4 * 24 * 14 * 64 * (5050 + sum(101 + i for i in range(9)))
    seconds = layers / 100e9 + head / 50e9
    assert bound.bound_seconds == pytest.approx(seconds, rel=1e-12)
    assert bound.peak_gflops == pytest.approx((layers + head) / seconds / 1e9, rel=1e-12)
    assert bound.bound_tok_s == pytest.approx(10 / seconds, rel=1e-12)
    assert bound.reached == pytest.approx(seconds / 4.0, rel=1e-12)


def test_bound_line() -> None:
    bound = MatmulBound(
        layer_flops=150 * 10**9,
        head_flops=50 * 10**9,
        attention_flops=5 * 10**9,
        layer_gflops=100.0,
        head_gflops=100.0,
        output_tokens=100,
        seconds=4.0,
    )
    assert bound.line().startswith(
        "matmul bound 50.0 tok/s (200.0 GFLOP of linears at 100.0 GFLOP/s: layers 100.0, LM head 100.0); "
    )
    assert "this run reached 50.0 % of it" in bound.line()


def test_probe_times_one_layer_and_the_head(tiny: Path) -> None:
    from pagedserve.dataplane.runner.model_loader import load_model

    model = load_model(tiny, "float32", "cpu")
    layer, head = probe_modules(model)
    # The owned layer's fused q/k/v and gate/up, o and down, then the LM head (tiny: 64 hidden,
    # 4 heads of 16, 2 KV heads, MLP 128, vocab 384).
    assert [(m.in_features, m.out_features) for m in layer] == [
        (64, 64 + 2 * 32),
        (64, 64),
        (64, 256),
        (128, 64),
    ]
    assert (head.in_features, head.out_features) == (64, 384)
    peak = probe_peak(model, rows=(2, 8), reps=1)
    assert set(peak.by_rows) == {2, 8}
    assert peak.layer_gflops == max(r[0] for r in peak.by_rows.values()) > 0
    assert peak.head_gflops == max(r[1] for r in peak.by_rows.values()) > 0


def test_profile_arithmetic() -> None:
    steps = [
        FakeStep("prefill", 300, 3, seconds=1.0, context_tokens=300, runner_seconds=1.0),
        FakeStep("decode", 4, 4, seconds=0.1, context_tokens=400, runner_seconds=0.08),
        FakeStep("decode", 6, 6, seconds=0.1, context_tokens=600, runner_seconds=0.08),
        FakeStep("decode", 6, 6, seconds=0.2, context_tokens=700, runner_seconds=0.16),
    ]
    assert decode_shape(steps) == (6, 1700 // 16)
    assert runner_share(steps) == pytest.approx(0.8)
    phases = {k: {"share": 0.0} for keys in COMPONENTS.values() for k in keys}
    phases["linear"]["share"], phases["lm_head"]["share"], phases["other"]["share"] = 0.5, 0.25, 0.25
    shares = component_shares(phases, 0.8)
    assert shares["matmul (linears, LM head)"] == pytest.approx(0.6)
    assert shares[OUTSIDE_RUNNER] == pytest.approx(0.2)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert decode_shape([steps[0]]) == (0, 0)
